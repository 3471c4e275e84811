"""The Grafana dashboard (deploy/grafana/prefixcache.json) against a real Prometheus scraping two real nodes of one
cluster, through which clients publish, look up and fetch: every query of every panel, its variables substituted as
Grafana does, returns numbers, and every metric a query names exists.

No vLLM engine runs here (one would cost minutes): the queries of vLLM's own metrics (``vllm:*``) are checked by
name instead, against vLLM's metric definitions and the connector's (connector/transfer_stats.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import vllm.v1.metrics.loggers

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.transfer_stats import COUNTS
from prefixcache.indexer.keys import prompt_query
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_for
from tests.prometheus_server import SCRAPE_INTERVAL_S, Prometheus, prometheus

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "prefixcache.json"
JOB = "prefixcache"  # the scrape job the alert rules name
TOKEN = "dashboard-test-admin-token"
#: What Grafana puts for ``$__rate_interval``: a window that holds both rounds of traffic.
RATE_INTERVAL = "1m"
METRIC = re.compile(r"\b(?:prefixcache_[a-z_]+|vllm:[a-z_]+)")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]


def _variable(dashboard: dict, name: str) -> dict:
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    return variable


def _substituted(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced as Grafana does; an unknown variable fails."""
    done = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)
    assert "$" not in done, done
    return done


def _vllm_defines(name: str) -> bool:
    """Whether vLLM's metrics (vllm/v1/metrics/loggers.py) or the connector's define the counter or histogram
    ``name`` is a series of."""
    base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
    ours = {f"vllm:prefixcache_{count}" for count in COUNTS}
    return base in ours or f'"{base}"' in Path(vllm.v1.metrics.loggers.__file__).read_text()


def test_the_dashboard_has_a_datasource_and_a_node_variable_every_query_uses():
    dashboard = _dashboard()
    datasource = _variable(dashboard, "datasource")
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert _variable(dashboard, "node")["type"] == "query"
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    ours = [expr for _, expr in _queries(dashboard) if any(n.startswith("prefixcache_") for n in METRIC.findall(expr))]
    assert ours and all('instance=~"$node"' in expr for expr in ours)
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_every_vllm_metric_the_dashboard_names_is_one_vllm_defines():
    named = {name for _, expr in _queries(_dashboard()) for name in METRIC.findall(expr) if name.startswith("vllm:")}
    assert {"vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"} <= named
    unknown = {name for name in named if not _vllm_defines(name)}
    assert not unknown, f"vLLM defines no such metrics: {sorted(unknown)}"


def _traffic(daemon: Daemon, first_token: int) -> None:
    """A round of what a connector does: publish a prompt, look it up, fetch it."""
    client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=daemon.index_password)
    try:
        tokens = list(range(first_token, first_token + 64 * 3))
        keys, _ = publish_prompt(client, tokens, seed=first_token)
        client.lookup(prompt_query(client.spec.root(), client.geometry, tokens))
        assert all(fetch_payloads(client, keys))
        client.recorder.flush()
    finally:
        client.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, list[Daemon]]]:
    """Two nodes of a cluster with a tenant quota, scraped by a Prometheus, after two rounds of traffic through
    each (two, so that every rate has two samples that differ)."""
    directory = tmp_path_factory.mktemp("dashboard")
    a = Daemon(directory / "a", "--admin-token", TOKEN).start()
    nodes = [a]
    try:
        nodes.append(a.joined_by(directory / "b", "node-b", "--admin-token", TOKEN).start())
        quota = httpx.put(f"{a.url}/v1/quotas/tenant/none", headers=a.headers, json={"limit_bytes": "1GiB"})
        assert quota.status_code == 200, quota.text
        targets = [f"127.0.0.1:{node.port}" for node in nodes]
        with prometheus(directory / "prometheus", JOB, targets, TOKEN) as server:
            for round_ in range(2):
                for i, node in enumerate(nodes):
                    _traffic(node, first_token=(round_ * 2 + i) * 1000)
                published = f'count(prefixcache_client_published_chunks_total{{job="{JOB}"}} > {round_})'
                assert wait_for(lambda q=published: server.has_numbers(q), timeout_s=30), "never scraped"
                time.sleep(2 * SCRAPE_INTERVAL_S)
            yield server, nodes
    finally:
        for node in reversed(nodes):
            node.stop()


def test_the_node_variable_lists_every_node(scraped):
    server, nodes = scraped
    query = _variable(_dashboard(), "node")["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", query).groups()
    assert sorted(server.label_values(label, metric)) == sorted(f"127.0.0.1:{node.port}" for node in nodes)


def test_every_panel_query_returns_numbers_from_real_nodes(scraped):
    server, nodes = scraped
    # both nodes picked, as Grafana writes several values into a regex within a PromQL string
    selected = "(" + "|".join(re.escape(f"127.0.0.1:{node.port}").replace("\\", "\\\\") for node in nodes) + ")"
    values = {"node": selected, "__rate_interval": RATE_INTERVAL}
    ours = [
        (title, _substituted(expr, values))
        for title, expr in _queries(_dashboard())
        if not any(name.startswith("vllm:") for name in METRIC.findall(expr))
    ]
    assert len(ours) >= 20
    wait_for(lambda: all(server.has_numbers(expr) for _, expr in ours), timeout_s=20)
    empty = [f"{title}: {expr}" for title, expr in ours if not server.has_numbers(expr)]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    exposed = server.metric_names()
    named = {name for _, expr in ours for name in METRIC.findall(expr)}
    assert not named - exposed, f"metrics no node exposes: {sorted(named - exposed)}"
