"""Tenant and namespace quotas against a real daemon: a tenant publishing past its quota loses its own least
recently used chunks and never another tenant's; a quota lowered below use evicts down to it; pins count."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.namespace import tenant_id
from prefixcache.indexer.quotas import QUOTA_REFRESH_S, QuotaGate, QuotaScope, QuotaStore
from prefixcache.indexer.redis_clients import redis_client
from tests.daemon_harness import Daemon, connect, fetch_payloads, publish_prompt, run_cli, wait_for

A, B = "salt-of-tenant-a", "salt-of-tenant-b"
CHUNK = 64  # tokens per chunk of make_spec()


def prompt(i: int, chunks: int) -> list[int]:
    return [i * 1000 + t for t in range(CHUNK * chunks)]


def hit_tokens(client: CacheClient, tokens: list[int], salt: str) -> int:
    return client.lookup(prompt_query(client.spec.root(salt), client.geometry, tokens)).matched_tokens


def quotas(daemon: Daemon) -> dict[str, dict]:
    answer = httpx.get(daemon.url + "/v1/quotas", headers=daemon.headers)
    assert answer.status_code == 200, answer.text
    return {f"{q['scope']}:{q['id']}": q for q in answer.json()}


def set_quota(daemon: Daemon, scope: str, limit: int | str) -> httpx.Response:
    return httpx.put(f"{daemon.url}/v1/quotas/{scope}", headers=daemon.headers, json={"limit_bytes": limit})


def chunk_bytes(client: CacheClient) -> int:
    keys, _ = publish_prompt(client, prompt(999, 1), tenant_salt="sizing")
    return client.index.get(keys)[0].size_bytes


def test_a_tenant_past_its_quota_evicts_its_own_chunks_never_anothers(tmp_path):
    limit = 1 << 20  # about 8 chunks; trimmed to half of it each round, which leaves room for about 4 more
    env = {"PREFIXCACHE_TENANT_QUOTAS": json.dumps({tenant_id(A): limit}), "PREFIXCACHE_QUOTA_LOW_WATERMARK": "0.5"}
    daemon = Daemon(tmp_path / "data", env=env).start()
    client = connect(daemon)
    try:
        theirs = [prompt(i, 4) for i in range(8)]
        payloads = [publish_prompt(client, tokens, seed=i, tenant_salt=B) for i, tokens in enumerate(theirs)]
        published = []
        for round_ in range(12):  # 48 chunks, six times the quota, over several rounds of the quota loop
            for i in range(4):
                stored: list[bool] = []
                publish_prompt(client, prompt(100 + 4 * round_ + i, 1), tenant_salt=A, stored=stored)
                if stored[0]:
                    published.append(100 + 4 * round_ + i)
            time.sleep(0.25)
        assert client.counters.over_quota > 0 and len(published) > 8  # skipped at quota, admitted again after
        assert wait_for(lambda: quotas(daemon)[f"tenant:{tenant_id(A)}"]["used_bytes"] <= limit)
        mine = quotas(daemon)[f"tenant:{tenant_id(A)}"]
        assert mine["source"] == "settings" and mine["limit_bytes"] == limit and mine["evicted_chunks"] > 0
        # the other tenant lost nothing: every chunk hits and reads back
        for tokens, (keys, chunks) in zip(theirs, payloads, strict=True):
            assert hit_tokens(client, tokens, B) == len(tokens)
            assert fetch_payloads(client, keys) == chunks
        stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()
        assert stats["tenants"][tenant_id(B)]["chunks"] == 32
        assert stats["tenants"][tenant_id(A)]["bytes"] <= limit
        assert any(q["id"] == tenant_id(A) for q in stats["quotas"])
        metrics = httpx.get(daemon.url + "/metrics", headers=daemon.headers).text
        samples = {
            (sample.name, sample.labels.get("id")): sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        }
        assert samples[("prefixcache_quota_limit_bytes", tenant_id(A))] == limit
        assert samples[("prefixcache_quota_evicted_chunks_total", tenant_id(A))] == mine["evicted_chunks"]
        # its least recently used chunks went first: the newest is kept
        assert hit_tokens(client, prompt(published[-1], 1), A) == CHUNK
        assert hit_tokens(client, prompt(published[0], 1), A) == 0
    finally:
        client.close()
        daemon.stop()


def test_a_quota_lowered_below_use_evicts_down_to_it_and_pins_count(daemon, client):
    mine = tenant_id(A)
    size = chunk_bytes(client)
    prompts = [prompt(i, 2) for i in range(10)]
    keys = [publish_prompt(client, tokens, tenant_salt=A)[0] for tokens in prompts]
    pinned = keys[0] + keys[1]
    answer = httpx.post(daemon.url + "/v1/pin", headers=daemon.headers, json={"keys": [k.hex() for k in pinned]})
    assert answer.status_code == 200 and answer.json()["chunks"] == 4
    for tokens in prompts[-3:]:  # the last three were used since: the least recently used are the others
        assert hit_tokens(client, tokens, A) == len(tokens)
    client.index.flush_access()

    limit = 12 * size
    answer = set_quota(daemon, f"tenant/{mine}", limit)
    assert answer.status_code == 200 and answer.json()["source"] == "api", answer.text
    assert wait_for(lambda: quotas(daemon)[f"tenant:{mine}"]["used_bytes"] <= limit)
    left = {e.key for e in client.index.get([k for ks in keys for k in ks]) if e is not None}
    assert set(pinned) <= left  # pinned chunks stay, and count
    assert all(hit_tokens(client, tokens, A) == len(tokens) for tokens in prompts[-3:])
    assert 4 + 6 <= len(left) <= 12 and quotas(daemon)[f"tenant:{mine}"]["evicted_chunks"] == 20 - len(left)

    # below what its pins hold: every unpinned chunk goes, the pinned stay, and its publishes are skipped
    assert set_quota(daemon, f"tenant/{mine}", "256KiB").status_code == 200
    assert wait_for(lambda: quotas(daemon)[f"tenant:{mine}"]["used_chunks"] == 4)
    state = quotas(daemon)[f"tenant:{mine}"]
    assert state["at_quota"] and state["used_bytes"] == 4 * size
    time.sleep(QUOTA_REFRESH_S + 0.2)  # the publisher's view of the scopes at quota is refreshed
    stored: list[bool] = []
    publish_prompt(client, prompt(50, 2), tenant_salt=A, stored=stored)
    assert stored == [False, False] and client.counters.over_quota == 2
    publish_prompt(client, prompt(50, 2), tenant_salt=B)  # another tenant publishes as before

    # deleting the API's quota lifts it
    assert httpx.delete(f"{daemon.url}/v1/quotas/tenant/{mine}", headers=daemon.headers).status_code == 200
    assert httpx.delete(f"{daemon.url}/v1/quotas/tenant/{mine}", headers=daemon.headers).status_code == 404
    assert f"tenant:{mine}" not in quotas(daemon)
    time.sleep(QUOTA_REFRESH_S + 1.2)  # the quota loop's next round, then the publisher's refresh
    publish_prompt(client, prompt(51, 2), tenant_salt=A)


def test_a_namespace_quota_bounds_every_tenant_of_it(daemon, client):
    size = chunk_bytes(client)
    for i in range(6):
        publish_prompt(client, prompt(i, 2), tenant_salt=A if i % 2 else B)
    namespace = client.spec.digest.hex()
    assert set_quota(daemon, f"namespace/{namespace}", 5 * size).status_code == 200
    assert wait_for(lambda: quotas(daemon)[f"namespace:{namespace}"]["used_bytes"] <= 5 * size)
    assert quotas(daemon)[f"namespace:{namespace}"]["used_chunks"] >= 4  # down to 90% of the quota, no further


def test_bad_quota_requests_are_refused_and_change_nothing(daemon):
    mine = tenant_id(A)
    assert set_quota(daemon, f"tenant/{mine}", 1 << 20).status_code == 200
    for path, body in [
        (f"tenant/{mine}", {"limit_bytes": -1}),
        (f"tenant/{mine}", {"limit_bytes": "lots"}),
        (f"tenant/{mine}", {"limit_bytes": 5, "extra": 1}),
        (f"tenant/{mine}", {}),
        ("tenant/" + "a" * 32, {"limit_bytes": 5}),  # a namespace digest is no tenant id
        ("namespace/" + "a" * 16, {"limit_bytes": 5}),
        ("tenant/xyz", {"limit_bytes": 5}),
        ("user/" + mine, {"limit_bytes": 5}),
    ]:
        answer = httpx.put(f"{daemon.url}/v1/quotas/{path}", headers=daemon.headers, json=body)
        assert answer.status_code in (404, 422), (path, body, answer.status_code)
    unauthenticated = httpx.put(f"{daemon.url}/v1/quotas/tenant/{mine}", json={"limit_bytes": 0})
    assert unauthenticated.status_code == 401
    assert httpx.get(f"{daemon.url}/v1/quotas").status_code == 401
    assert quotas(daemon)[f"tenant:{mine}"]["limit_bytes"] == 1 << 20


def test_the_cli_sets_lists_and_deletes_quotas(daemon):
    mine = run_cli(daemon, "quota", "tenant-id", stdin=A)
    assert mine.returncode == 0 and mine.stdout.strip() == tenant_id(A)
    assert run_cli(daemon, "quota", "set", "tenant", tenant_id(A), "2MiB").returncode == 0
    listed = run_cli(daemon, "quota", "list", "--json")
    assert [(q["id"], q["limit_bytes"]) for q in json.loads(listed.stdout)] == [(tenant_id(A), 2 << 20)]
    refused = run_cli(daemon, "quota", "set", "tenant", tenant_id(A), "plenty")
    assert refused.returncode == 2 and "limit_bytes" in refused.stderr
    assert run_cli(daemon, "quota", "delete", "tenant", tenant_id(A)).returncode == 0
    assert json.loads(run_cli(daemon, "quota", "list", "--json").stdout) == []


@pytest.mark.parametrize("deployment", ["redis_server", "redis_cluster"])
def test_publishers_of_one_tenant_together_add_at_most_a_rounds_room(deployment, request):
    """Two engines' gates, each with a client of its own, asking at once for three times the room: together they
    admit no more than it, and the spending counter ends at what they admitted (what each refused given back). On
    a Cluster the round's room and each counter are keys of slots of their own."""
    url = request.getfixturevalue(deployment).url
    room, size, calls = 10_000, 100, 50
    keys, tenant = Keyspace(f"gates{time.monotonic_ns()}"), QuotaScope.of_tenant(tenant_id(A))
    writer = QuotaStore(redis_client(url), keys)
    writer.set_room("round-1", {tenant: room})
    gates = [QuotaGate(QuotaStore(redis_client(url), keys)) for _ in range(2)]
    admitted = [0, 0]

    def publish(i: int) -> None:
        for _ in range(calls):
            answers = gates[i].admit(tenant_id(A), [(bytes(16), size)] * 3)
            admitted[i] += size * sum(answers)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert room - 6 * size <= sum(admitted) <= room, admitted
    assert writer.spend("round-1", {tenant: 0}) == {tenant: sum(admitted)}
