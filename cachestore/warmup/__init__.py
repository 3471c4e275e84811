"""Warm-up jobs: compute and store the KV of a known prompt corpus before the first real request needs it.

``corpus`` parses and checks the input, ``state`` records which prompts are done (so jobs resume and
reruns do nothing), ``plan`` decides what to skip and in which order to run the rest, ``engine`` runs
vLLM offline with the connector as ``kv_producer``, ``runner`` ties them together with ``progress``
and ``report``; ``jobs`` runs them for the daemon's ``/v1/warmup`` endpoints (cachestore/api/warmup_routes.py)
in a child process, the same ``prefixcache warmup`` command (cachestore/cli/warmup.py) an operator runs.
"""
