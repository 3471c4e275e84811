"""vLLM's KV cache in shared memory, so that loads write chunks straight into its pages.

On the CPU backend vLLM allocates the whole KV cache as one zero-filled int8 tensor, inside the
context the connector returns from ``get_mem_pool_context``. ``SharedKVAllocation`` intercepts that
one ``torch.zeros`` call and hands back a tensor over memory from ``allocate`` (the client's
Mooncake-registered shared memory), where the segment owner can write. Anything else, or an
allocation that fails, takes the ordinary path: loads then copy through the arena as before. The
memory belongs to the client, which the connector closes at shutdown, after the last forward pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("prefixcache.connector")


class SharedKVAllocation(TorchFunctionMode):
    def __init__(self, allocate: Callable[[int], memoryview]) -> None:
        super().__init__()
        self._allocate = allocate
        self.allocated: memoryview | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.allocated is None and _is_kv_buffer(args, kwargs):
            size = math.prod(args[0]) if isinstance(args[0], (tuple, list, torch.Size)) else int(args[0])
            try:
                self.allocated = self._allocate(size)
            except Exception as exc:  # noqa: BLE001 - the engine must start; loads copy through the arena instead
                log.warning("prefixcache: KV cache not placed in shared memory (%s); loads copy through the arena", exc)
                return func(*args, **kwargs)
            log.info("prefixcache: KV cache (%d MiB) in shared memory: loads write straight into its pages", size >> 20)
            return torch.frombuffer(self.allocated, dtype=torch.int8)
        return func(*args, **kwargs)


def _is_kv_buffer(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A one-dimensional int8 ``torch.zeros`` on the CPU, as ``allocate_kv_cache`` makes."""
    if len(args) != 1 or set(kwargs) - {"dtype", "device"} or kwargs.get("dtype") is not torch.int8:
        return False
    shape = args[0]
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) != 1:
        return False
    return torch.device(kwargs.get("device") or "cpu").type == "cpu"
