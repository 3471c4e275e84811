"""End-to-end tests: real vLLM engines (CPU build) on a tiny random-weight Llama, run in fresh subprocesses."""
