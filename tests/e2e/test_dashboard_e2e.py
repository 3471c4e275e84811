"""The Grafana dashboard (deploy/grafana/prefixcache.json) against a real Prometheus scraping vLLM's OpenAI server
with the connector and the two nodes of a cluster (the server's and another, with a tenant quota), after a short
burst of traffic with hits: every query of every panel, vLLM's metrics' included, its variables substituted as
Grafana does, returns data, and every metric it names is exposed.

The server runs with vLLM's own prefix cache off (as every e2e server does, so that its hits are the connector's),
so the ratio of its own hits to its own queries is 0 / 0 there: that query is held to returning series, the others
to returning numbers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.daemon_harness import Daemon, connector_config, stored_tokens, wait_for
from tests.dashboard_queries import dashboard, metrics, queries, selected_nodes, substituted
from tests.e2e.openai_server import MODEL, Server, metric, vllm_server
from tests.e2e.tinymodel import random_prompt
from tests.prometheus_server import SCRAPE_INTERVAL_S, Prometheus, ScrapeJob, prometheus

pytestmark = pytest.mark.e2e

TOKEN = "dashboard-e2e-admin-token"
LOADED = "vllm:prefixcache_loaded_chunks_total"
#: One prompt a round, each sent twice: computed and published, then loaded (two chunks and an 88-token tail).
PROMPTS = [random_prompt(seed=seed, length=600) for seed in (41, 42)]
#: vLLM's own hits over its own queries, 0 / 0 while its prefix cache is off.
OWN_PREFIX_CACHE_RATIO = re.compile(r"^sum\(rate\(vllm:prefix_cache_hits_total\[[^]]*\]\)\) / ")


def _complete(server: Server, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def scraped(tiny_model, tmp_path_factory) -> Iterator[tuple[Prometheus, list[Daemon]]]:
    logs = tmp_path_factory.mktemp("dashboard-e2e")
    daemon = Daemon(logs / "data", "--admin-token", TOKEN, dram="512MiB", nvme="1GiB").start()
    nodes, server = [daemon], None
    try:
        nodes.append(daemon.joined_by(logs / "other", "node-b", "--admin-token", TOKEN).start())
        quota = httpx.put(f"{daemon.url}/v1/quotas/tenant/none", headers=daemon.headers, json={"limit_bytes": "1GiB"})
        assert quota.status_code == 200, quota.text
        server = vllm_server("vllm", tiny_model, connector_config(daemon), logs).wait_ready()
        jobs = [
            ScrapeJob("prefixcache", [f"127.0.0.1:{node.port}" for node in nodes], TOKEN),
            ScrapeJob("vllm", [f"127.0.0.1:{server.port}"]),
        ]
        with prometheus(logs / "prometheus", jobs) as prom:
            for prompt in PROMPTS:  # a round each, so that every rate has two samples that differ
                _complete(server, prompt)
                # published behind the engine: the second request must find it (a lookup at once may miss)
                assert wait_for(lambda prompt=prompt: stored_tokens(daemon, prompt) == len(prompt), timeout_s=30)
                _complete(server, prompt)
                loaded = wait_for(lambda: metric(server, LOADED) > 0, timeout_s=30) and metric(server, LOADED)
                assert loaded, "the second request of a prompt loaded nothing"
                assert wait_for(lambda n=loaded: prom.has_numbers(f"sum({LOADED}) >= {n}"), timeout_s=30)
                time.sleep(2 * SCRAPE_INTERVAL_S)
            yield prom, nodes
    finally:
        if server is not None:
            server.kill()
        for node in reversed(nodes):
            node.stop()


def test_every_panel_query_returns_data_from_a_daemon_and_vllm(scraped):
    prom, nodes = scraped
    node = selected_nodes([f"127.0.0.1:{n.port}" for n in nodes])
    every = [(title, substituted(expr, {"node": node})) for title, expr in queries(dashboard())]
    must_be_numbers = [(title, expr) for title, expr in every if not OWN_PREFIX_CACHE_RATIO.match(expr)]
    assert len(every) - len(must_be_numbers) == 1
    wait_for(lambda: all(prom.has_numbers(expr) for _, expr in must_be_numbers), timeout_s=20)
    missing = [f"{title}: {expr}" for title, expr in must_be_numbers if not prom.has_numbers(expr)]
    missing += [f"{title}: {expr}" for title, expr in every if not prom.query(expr)]
    assert not missing, "queries without data:\n" + "\n".join(missing)
    assert prom.query(f"sum(rate({LOADED}[1m])) > 0"), "no loads in the window the panels show"
    named = set().union(*(metrics(expr) for _, expr in every))
    assert not named - prom.metric_names(), f"metrics nothing exposes: {sorted(named - prom.metric_names())}"
