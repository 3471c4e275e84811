"""Token ids to chunk keys, namespaces, and the index that answers "how much of this prompt is cached?".

``tokens``, ``chunking`` and ``keys`` make keys, ``namespace`` and ``fingerprint`` namespaces, ``index`` is the index
protocol and its records; ``redis_index`` (with ``redis_clients``, ``redis_shards``, ``leases`` and ``access_log``)
its Redis backend, on one Redis, behind Sentinel or over a Redis Cluster.
This package imports none of them, so that importing the pure ones loads no Redis client.
"""
