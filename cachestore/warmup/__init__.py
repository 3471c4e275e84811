"""Warm-up jobs: compute and store the KV of a known prompt corpus before the first real request needs it.

``corpus`` parses and checks the input, ``state`` records which prompts are done (so jobs resume and
reruns do nothing), ``plan`` decides what to skip and in which order to run the rest, ``engine`` runs
vLLM offline with the connector as ``kv_producer``, ``runner`` ties them together with ``progress``
and ``report``; ``command`` is the ``prefixcache warmup`` CLI, ``jobs`` and ``api`` the daemon's
``/v1/warmup`` endpoints, which run the same command in a child process.
"""
