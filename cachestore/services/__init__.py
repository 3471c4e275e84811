"""The daemon's background services: write-behind, promotion, demotion, eviction, reconciliation, KV events."""
