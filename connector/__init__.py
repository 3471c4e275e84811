"""The vLLM KV-connector plugin: maps vLLM's paged KV to and from prefixcache chunks, and nothing else.

Load it with ``kv_connector_module_path="connector"`` and ``kv_connector="PrefixCacheConnector"``. This
module is imported while vLLM builds its configuration, so it imports nothing heavy.
"""

from connector.plugin import PrefixCacheConnector

__all__ = ["PrefixCacheConnector"]
