"""The vLLM KV-connector plugin (``PrefixCacheConnector``): maps vLLM's paged KV to and from chunks.

It arrives with the connector issue; this package exists so the distribution's layout is final.
"""
