"""Mooncake, imported here for the DRAM tier and the Mooncake servers, or one error naming the extra to install.

Mooncake comes in a CPU build and a CUDA build, each in an extra of its own (``prefixcache[cpu]``,
``prefixcache[cuda]``), and the core install has neither. A node or a connector started without one says which to
install, in one line, instead of failing on an import deep in a traceback.
"""

from __future__ import annotations

from prefixcache.indexer.errors import PrefixCacheError


class MissingExtraError(PrefixCacheError, ImportError):
    """A package that only an extra installs cannot be imported. An ``ImportError`` too, so that code probing for an
    optional import treats it as one."""


try:
    import mooncake
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
except ImportError as exc:
    raise MissingExtraError(
        f"the DRAM tier needs Mooncake, which cannot be imported ({exc}): "
        "install prefixcache[cpu] on a CPU host or prefixcache[cuda] on an NVIDIA host"
    ) from None

__all__ = ["MissingExtraError", "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "mooncake"]
