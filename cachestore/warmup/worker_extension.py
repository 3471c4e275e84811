"""Methods vLLM mixes into its worker class (``worker_extension_cls``) so a warm-up can ask the connector.

Loaded by import path in every worker process; called with ``LLM.collective_rpc``. Only plain values
cross the process boundary.
"""

from __future__ import annotations


class PrefixCacheWorkerExtension:
    def prefixcache_namespace(self) -> str:
        """The namespace the connector publishes under in this worker, as JSON (a ``NamespaceSpec``).

        Read from the connector's own client rather than derived again, so the warm-up's lookups can
        never use a namespace other than the one its chunks are stored in.
        """
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        namespace = getattr(get_kv_transfer_group(), "worker_namespace", None) if has_kv_transfer_group() else None
        if namespace is None:
            raise RuntimeError("PrefixCacheConnector is not active in this worker")
        return str(namespace.model_dump_json())
