"""Token ids to chunk keys, namespaces, and the index that answers "how much of this prompt is cached?".

``tokens``, ``chunking`` and ``keys`` make keys, ``namespace`` and ``fingerprint`` namespaces, ``index`` is the index
protocol and its records; ``redis_index`` (with ``redis_clients``, ``leases`` and ``access_log``) its Redis backend.
This package imports none of them, so that importing the pure ones loads no Redis client.
"""
