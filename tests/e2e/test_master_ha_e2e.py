"""The Mooncake master's leader killed under vLLM: a node of a cluster whose masters run in high-availability mode
(etcd, two masters: tests/daemon_harness.py's ``ha_cluster_servers``) serves vLLM's OpenAI server, whose prompts hit
the node's DRAM; the leader is killed with requests streaming. No request fails, every answer equals the cold
recompute of its prompt, hits resume once the standby leads (Mooncake's election takes about 10 s: the issue's 15 s,
with this machine's margin), and the old leader, started again, stands by."""

from __future__ import annotations

import time

import pytest

from benchmarks.node_loss import complete, loaded
from tests.daemon_harness import Daemon, connector_config, ha_cluster_servers, wait_for
from tests.e2e.openai_server import vllm_server
from tests.e2e.tinymodel import random_prompt
from tests.etcd_server import MISSING

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

PROMPTS = [random_prompt(seed=900 + i, length=1100) for i in range(3)]
#: Seconds requests go on after the kill.
STREAM_S = 35.0
#: The issue's bound on hits resuming after the leader is lost, and this machine's margin over it.
RESUMED_WITHIN_S = 15 + 10


def test_a_leader_killed_under_vllm_fails_no_request_and_hits_resume(tiny_model, tmp_path):
    with ha_cluster_servers(tmp_path / "servers") as servers:
        node = Daemon.joining_ha(servers, tmp_path / "node", "node-a").start()
        try:
            transfer = connector_config(node, redis_password=node.index_password)
            details = "--enable-prompt-tokens-details"  # cached tokens in each answer's usage
            server = vllm_server("vllm-ha", tiny_model, transfer, tmp_path, details, served_name=None).wait_ready()
            try:
                complete(server.url, PROMPTS[0], load=False)  # the engine's first request pays its warm-up
                # computed whole, and published: the answers every request must equal, and the hits to come
                cold = {i: complete(server.url, p, load=False) for i, p in enumerate(PROMPTS)}

                assert wait_for(lambda: loaded(*complete(server.url, PROMPTS[0])[:2], cold[0][0]), timeout_s=30)
                leader = servers.leader()
                leader.kill()
                killed = time.monotonic()
                seen = []  # (seconds after the kill, hit)
                turn = 0
                while time.monotonic() - killed < STREAM_S:
                    i = turn % len(PROMPTS)
                    turn += 1
                    sent = time.monotonic() - killed
                    ttft, cached, text = complete(server.url, PROMPTS[i])  # raises if the request fails
                    assert text == cold[i][2], f"request {turn} after the kill answered differently"
                    seen.append((round(sent, 1), loaded(ttft, cached, cold[i][0])))
                # hits may come and go while the standby takes over; from the bound on, requests hit (but for one
                # now and then that this shared machine slows past half its cold time)
                later = [was_hit for at, was_hit in seen if at > RESUMED_WITHIN_S]
                assert later and sum(later) >= 0.8 * len(later), seen
                leader.start()  # the old leader, back: it stands by
                assert wait_for(lambda: servers.role(leader) == "standby", 15), servers.role(leader)
            finally:
                server.kill()
        finally:
            node.stop()
