"""One chunk as bytes: its stored form (codec), its MAC, and the registered arena its copies pass through."""
