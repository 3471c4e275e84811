"""The Grafana dashboard (deploy/grafana/prefixcache.json) against a real Prometheus scraping two real nodes of one
cluster, through which clients publish, look up and fetch: every query of every panel that names prefixcache's
metrics alone, its variables substituted as Grafana does, returns numbers, and every metric a query names exists.

The queries of vLLM's own metrics (``vllm:*``) are checked here by name, against vLLM's metric definitions and the
connector's (connector/transfer_stats.py); tests/e2e/test_dashboard_e2e.py runs them against a vLLM engine.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.indexer.keys import prompt_query
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_for
from tests.dashboard_queries import (
    dashboard,
    metrics,
    names_vllm,
    panels,
    queries,
    selected_nodes,
    substituted,
    variable,
    vllm_defines,
)
from tests.prometheus_server import SCRAPE_INTERVAL_S, Prometheus, ScrapeJob, prometheus

JOB = "prefixcache"  # the scrape job the alert rules name
TOKEN = "dashboard-test-admin-token"


def test_the_dashboard_has_a_datasource_and_a_node_variable_every_query_uses():
    board = dashboard()
    datasource = variable(board, "datasource")
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert variable(board, "node")["type"] == "query"
    for panel in panels(board):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    ours = [expr for _, expr in queries(board) if any(n.startswith("prefixcache_") for n in metrics(expr))]
    assert ours and all('instance=~"$node"' in expr for expr in ours)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))


def test_every_vllm_metric_the_dashboard_names_is_one_vllm_defines():
    named = {name for _, expr in queries(dashboard()) for name in metrics(expr) if name.startswith("vllm:")}
    assert {"vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"} <= named
    unknown = {name for name in named if not vllm_defines(name)}
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
        with prometheus(directory / "prometheus", [ScrapeJob(JOB, targets, TOKEN)]) as server:
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
    query = variable(dashboard(), "node")["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", query).groups()
    assert sorted(server.label_values(label, metric)) == sorted(f"127.0.0.1:{node.port}" for node in nodes)


def test_every_panel_query_returns_numbers_from_real_nodes(scraped):
    server, nodes = scraped
    node = selected_nodes([f"127.0.0.1:{n.port}" for n in nodes])  # both nodes picked
    ours = [(title, substituted(expr, {"node": node})) for title, expr in queries(dashboard()) if not names_vllm(expr)]
    assert len(ours) >= 20
    wait_for(lambda: all(server.has_numbers(expr) for _, expr in ours), timeout_s=20)
    empty = [f"{title}: {expr}" for title, expr in ours if not server.has_numbers(expr)]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    exposed = server.metric_names()
    named = set().union(*(metrics(expr) for _, expr in ours))
    assert not named - exposed, f"metrics no node exposes: {sorted(named - exposed)}"
