"""One node's daemon: its settings, the servers it starts and keeps running, its data-dir lock."""
