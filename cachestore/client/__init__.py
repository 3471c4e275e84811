"""The library vLLM workers and warm-up jobs import: look up, publish and fetch chunks (no REST API, no daemon)."""
