"""The daemon's REST API (management only; KV bytes never pass through it)."""
