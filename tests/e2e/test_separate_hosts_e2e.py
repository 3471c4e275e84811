"""vLLM engines on hosts of their own (tests/netns.py), each with the connector and its own host's
``prefixcache serve``: engine A, in host A, publishes; engine B, in host B with vLLM's own prefix cache off,
loads the KV A computed from A's DRAM segment over the network (Mooncake TCP) and answers as an engine without
the connector. The cluster's Redis and Mooncake master run in the root namespace, as in
tests/test_separate_hosts.py, whose module docstring says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.daemon_harness import Daemon, cluster_servers, connector_config, node_on
from tests.e2e.compare import same_greedy_output
from tests.e2e.tinymodel import random_prompt
from tests.netns import Host, Network, unusable

pytestmark = pytest.mark.e2e

PROMPTS = [random_prompt(seed=41, length=1100), random_prompt(seed=42, length=1100)]


@dataclass
class Node:
    host: Host
    daemon: Daemon

    def connector(self) -> dict:
        """The connector's kv_transfer_config for an engine on this node (the index's password given: it is
        not the node's own)."""
        return connector_config(self.daemon, redis_password=self.daemon.index_password)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    reason = unusable()
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("hosts-e2e")
    with Network() as network, cluster_servers(directory / "servers", network.gateway) as servers:
        hosts = network.host("a"), network.host("b")
        a, b = (Node(h, node_on(h, servers, directory / h.name, dram="512MiB", nvme="2GiB")) for h in hosts)
        try:
            a.daemon.start()
            b.daemon.start()
            yield a, b
        finally:
            b.daemon.stop()
            a.daemon.stop()


def test_an_engine_on_one_host_loads_the_kv_an_engine_on_another_host_published(run_vllm, tiny_model, nodes):
    a, b = nodes
    reference = run_vllm({"model": str(tiny_model), "prompts": PROMPTS, "max_tokens": 16})
    publisher = run_vllm(
        {"model": str(tiny_model), "prompts": PROMPTS, "max_tokens": 16, "kv_transfer_config": a.connector()},
        launcher=a.host.launcher,
    )
    sent = a.host.sent_bytes()
    reader = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": PROMPTS,
            "max_tokens": 16,
            "prefix_caching": False,
            "kv_transfer_config": b.connector(),
        },
        launcher=b.host.launcher,
    )
    assert [r["num_cached_tokens"] for r in publisher["outputs"]] == [0, 0]
    assert [r["num_cached_tokens"] for r in reader["outputs"]] == [len(p) - 1 for p in PROMPTS]
    for ref, got in zip(reference["outputs"], reader["outputs"], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason
    metrics = reader["metrics"]
    assert metrics["vllm:prompt_tokens_cached_by_source:host"] == sum(len(p) - 1 for p in PROMPTS)
    assert metrics.get("vllm:prefixcache_load_failed_blocks", 0) == 0
    loaded = metrics["vllm:prefixcache_loaded_bytes"]
    assert loaded > 0 and a.host.sent_bytes() - sent >= loaded, "B's KV came from A's segment, over the network"
