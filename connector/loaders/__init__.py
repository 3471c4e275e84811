"""The ways chunks get into vLLM's pages on the connector's worker side (connector/worker_side.py)."""
