"""The base classes of ``prefixcache.connector.transfer_stats``, as much of them as the worker side uses."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data


class KVConnectorPromMetrics:
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self.per_engine_labelvalues = per_engine_labelvalues
