"""vLLM's plugin hook (entry point ``vllm.general_plugins``): names ``PrefixCacheConnector`` in its connector factory.

vLLM calls every general plugin in each of its processes before it builds a connector, so with prefixcache
installed ``"kv_connector": "PrefixCacheConnector"`` finds the class without ``kv_connector_module_path``.
Registering imports nothing heavy: the factory imports the plugin module when a connector is first built.
"""

from __future__ import annotations

import contextlib

CONNECTOR_NAME = "PrefixCacheConnector"


def register() -> None:
    """Register the connector with vLLM's factory; a second call in one process changes nothing."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered here: vLLM may load its plugins more than once
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "prefixcache.connector.plugin", CONNECTOR_NAME)
