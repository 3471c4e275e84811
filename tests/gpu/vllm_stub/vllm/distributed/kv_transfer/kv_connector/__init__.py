"""Stub of vLLM for the GPU check (tests/gpu/check.sh): the GPU machine has torch but no vLLM."""
