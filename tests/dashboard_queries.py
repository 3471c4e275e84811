"""The Grafana dashboard's queries (deploy/grafana/prefixcache.json) as Grafana sends them: every target of every
panel, its variables substituted, and the metrics each names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import vllm.v1.metrics.loggers

from prefixcache.connector.transfer_stats import COUNTS

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "prefixcache.json"
#: What Grafana puts for ``$__rate_interval`` in these tests: a window that holds every round of their traffic.
RATE_INTERVAL = "1m"
METRIC = re.compile(r"\b(?:prefixcache_[a-z_]+|vllm:[a-z_]+)")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in panels(board) for t in p.get("targets", [])]


def variable(board: dict, name: str) -> dict:
    (found,) = [v for v in board["templating"]["list"] if v["name"] == name]
    return found


def metrics(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def names_vllm(expr: str) -> bool:
    return any(name.startswith("vllm:") for name in metrics(expr))


def selected_nodes(instances: Sequence[str]) -> str:
    """The ``node`` variable with ``instances`` picked, as Grafana writes several values into a regex within a
    PromQL string."""
    return "(" + "|".join(re.escape(i).replace("\\", "\\\\") for i in instances) + ")"


def substituted(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced as Grafana does (``$__rate_interval`` by ``RATE_INTERVAL``);
    an unknown variable fails."""
    values = {"__rate_interval": RATE_INTERVAL, **values}
    done = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)
    assert "$" not in done, done
    return done


def vllm_defines(name: str) -> bool:
    """Whether vLLM's metrics (vllm/v1/metrics/loggers.py) or the connector's define the counter or histogram
    ``name`` is a series of."""
    base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
    ours = {f"vllm:prefixcache_{count}" for count in COUNTS}
    return base in ours or f'"{base}"' in Path(vllm.v1.metrics.loggers.__file__).read_text()
