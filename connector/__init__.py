"""The vLLM KV-connector plugin: maps vLLM's paged KV to and from prefixcache chunks, and nothing else.

Load it with ``kv_connector_module_path="prefixcache.connector"`` and ``kv_connector="PrefixCacheConnector"``. This
module is imported while vLLM builds its configuration, so it imports nothing heavy; the plugin itself
(which needs vLLM) is imported when vLLM asks for it, so the page copies and plans import without vLLM.
"""

from typing import Any

__all__ = ["PrefixCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "PrefixCacheConnector":
        from prefixcache.connector.plugin import PrefixCacheConnector

        return PrefixCacheConnector
    raise AttributeError(f"module 'prefixcache.connector' has no attribute {name!r}")
