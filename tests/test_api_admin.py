"""The admin API against a real daemon (redis-server, mooncake_master, segment owner, RocksDB)."""

# ruff: noqa: F811 - the shared fixtures are imported by name

from __future__ import annotations

import json
import time

import httpx
import redis

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.indexer.keyspace import Keyspace
from tests.admin_stack import TOKEN, api, client, daemon  # noqa: F401 - fixtures
from tests.daemon_harness import fetch_payloads, make_spec, publish_prompt, wait_persisted

CHUNK = 64  # make_spec()'s chunk size


def ns(client) -> str:
    return client.spec.digest.hex()


def listed(api, **params) -> list[str]:
    keys, cursor = [], None
    while True:
        page = api.get("/v1/chunks", params={**params, "limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        keys += [c["key"] for c in page["chunks"]]
        if not (cursor := page["next_cursor"]):
            return keys


def test_without_the_token_only_health_and_config_answer(daemon):
    with httpx.Client(base_url=daemon.url) as anonymous:
        assert anonymous.get("/v1/health").status_code == 200
        assert TOKEN not in anonymous.get("/v1/config").text  # it names secret files (admin_token), never values
        calls = [
            ("GET", "/v1/stats"),
            ("GET", "/v1/chunks"),
            ("GET", "/metrics"),
            ("POST", "/v1/evict"),
            ("POST", "/v1/pin"),
            ("DELETE", "/v1/chunks/" + "0" * 32),
        ]
        for method, path in calls:
            response = anonymous.request(method, path, json={"all": True})
            assert response.status_code == 401, path
            assert response.headers["www-authenticate"] == "Bearer"
        wrong = anonymous.post(
            "/v1/evict", json={"all": True}, headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}
        )
        assert wrong.status_code == 401 and "s3cret" not in wrong.text


def test_lookup_reports_matched_tokens_and_each_chunks_tier(api, client):
    tokens = list(range(CHUNK * 3 + 20))
    keys, _ = publish_prompt(client, tokens)
    wait_persisted(client, keys, timeout_s=20)
    found = api.post("/v1/lookup", json={"namespace": ns(client), "token_ids": tokens + [99999] * 10}).json()
    assert found["requested_tokens"] == len(tokens) + 10 and found["matched_tokens"] == len(tokens)
    assert [c["key"] for c in found["chunks"]] == [k.hex() for k in keys] and found["matched_chunks"] == 4
    assert all(c["tiers"] == ["dram", "nvme"] for c in found["chunks"])
    by_spec = api.post("/v1/lookup", json={"spec": client.spec.model_dump(), "token_ids": tokens[:100]}).json()
    assert by_spec["matched_tokens"] == 100 and by_spec["chunks"][-1]["matched_tokens"] == 36
    assert all(e.hits == 0 for e in client.index.get(keys))  # inspecting is not using


def test_chunks_list_filter_paginate_and_show_one(api, client):
    keys, _ = publish_prompt(client, list(range(CHUNK * 5)))
    assert listed(api) == sorted(k.hex() for k in keys)
    assert listed(api, namespace=ns(client), tier="dram", pinned=False) == sorted(k.hex() for k in keys)
    assert listed(api, namespace="0" * 32) == [] and listed(api, newer_than_s=0) == []
    assert listed(api, min_hits=1) == []
    one = api.get(f"/v1/chunks/{keys[0].hex().upper()}").json()
    assert one["key"] == keys[0].hex() and one["tokens"] == CHUNK and one["namespace"] == ns(client)
    assert api.get("/v1/chunks/" + "ab" * 16).status_code == 404
    assert api.get("/v1/chunks/not-a-key").status_code == 422
    assert api.get("/v1/chunks", params={"limit": 5000}).status_code == 422


def test_evict_by_prefix_removes_exactly_its_chunks_and_those_below_from_every_tier(api, client):
    prompt, _ = publish_prompt(client, list(range(CHUNK * 4 + 10)), seed=1)
    branch, _ = publish_prompt(client, list(range(CHUNK)) + [7] * 100, seed=2)  # shares the first chunk
    other, other_payloads = publish_prompt(client, list(range(1000, 1000 + CHUNK * 2)), seed=3)
    wait_persisted(client, prompt + branch + other, timeout_s=20)
    gone = set(prompt + branch)  # branch[0] is prompt[0]
    body = {"prefix": {"namespace": ns(client), "token_ids": list(range(CHUNK * 2))}}
    dry = api.post("/v1/evict", json={**body, "dry_run": True}).json()
    assert dry["dry_run"] and dry["chunks"] == len(gone) and set(dry["sample_keys"]) == {k.hex() for k in gone}
    assert len(listed(api)) == len(gone) + len(other)  # a dry run removes nothing
    result = api.post("/v1/evict", json=body).json()
    assert result["chunks"] == len(gone) and result["failed"] == 0 and result["kept_elsewhere"] == 0
    assert listed(api) == sorted(k.hex() for k in other)
    assert client.dram.contains(list(gone)) == [False] * len(gone)
    assert fetch_payloads(client, list(gone)) == [None] * len(gone)  # not in DRAM, not promotable from NVMe
    stats = api.get("/v1/stats").json()
    assert stats["nvme"]["chunks"] == len(other) and stats["evictions"]["requested_chunks"] >= len(gone)
    assert stats["namespaces"][ns(client)]["chunks"] == len(other)
    assert fetch_payloads(client, other) == other_payloads


def test_pinned_chunks_survive_an_eviction_storm(api, client):
    pinned, payloads = publish_prompt(client, list(range(CHUNK * 3)), seed=4)
    rest, _ = publish_prompt(client, list(range(5000, 5000 + CHUNK * 6)), seed=5)
    wait_persisted(client, pinned + rest, timeout_s=20)
    answer = api.post("/v1/pin", json={"prefix": {"namespace": ns(client), "token_ids": list(range(CHUNK * 3))}})
    assert answer.json()["chunks"] == 3 and answer.json()["pinned_until_s"] is None
    storm = [
        {"all": True},
        {"where": {"tier": "dram"}},
        {"where": {"namespace": ns(client)}},
        {"keys": [k.hex() for k in pinned + rest]},
        {"prefix": {"namespace": ns(client), "token_ids": [0]}},
    ]
    for body in storm:
        assert api.post("/v1/evict", json=body).status_code == 200
    assert listed(api) == sorted(k.hex() for k in pinned)
    assert listed(api, pinned=True) == listed(api)
    assert fetch_payloads(client, pinned) == payloads
    assert api.delete(f"/v1/chunks/{pinned[0].hex()}").status_code == 409
    assert api.post("/v1/unpin", json={"keys": [pinned[0].hex()]}).json()["chunks"] == 1
    assert api.delete(f"/v1/chunks/{pinned[0].hex()}").json()["chunks"] == 1
    assert api.post("/v1/evict", json={"all": True, "force": True}).json()["chunks"] == 2
    assert listed(api) == []


def test_a_pin_with_a_ttl_expires(api, client):
    keys, _ = publish_prompt(client, list(range(CHUNK)), seed=6)
    until = api.post("/v1/pin", json={"keys": [keys[0].hex()], "ttl_s": 3600}).json()["pinned_until_s"]
    assert until is not None and api.get(f"/v1/chunks/{keys[0].hex()}").json()["pinned_until_s"] == until
    api.post("/v1/pin", json={"keys": [keys[0].hex()], "ttl_s": 0.05})
    time.sleep(0.1)  # an evict inside the pin's lifetime is rightly refused
    assert api.post("/v1/evict", json={"keys": [keys[0].hex()]}).json()["chunks"] == 1


def test_stats_and_metrics_count_what_clients_did(api, client, daemon):
    from prefixcache.indexer.keys import prompt_query

    tokens = list(range(CHUNK * 2))
    keys, _ = publish_prompt(client, tokens, seed=7)
    client.lookup(prompt_query(client.spec.root(), client.geometry, tokens))
    client.lookup(prompt_query(client.spec.root(), client.geometry, [123456] * 50))
    fetch_payloads(client, keys)
    client.recorder.flush()
    usage = api.get("/v1/stats").json()["namespaces"][ns(client)]
    assert usage["clients"]["hits"] >= 1 and usage["clients"]["misses"] >= 1
    assert usage["clients"]["matched_tokens"] >= len(tokens) and usage["chunks"] == 2
    assert api.get("/v1/namespaces").json()[0]["spec"]["model"] == "test-model"
    text = api.get("/metrics").text
    assert f'prefixcache_client_lookup_seconds_bucket{{le="+Inf",namespace="{ns(client)}"}}' in text
    assert 'prefixcache_tier_capacity_bytes{tier="nvme"}' in text and "prefixcache_queue_depth" in text
    assert TOKEN not in text


def test_bad_bodies_get_clear_4xx_answers(api, client):
    bad = [
        {"keys": ["zz" * 16]},
        {"keys": []},
        {"all": True, "keys": ["00" * 16]},
        {},
        {"prefix": {"namespace": ns(client), "token_ids": [-1]}},
        {"prefix": {"namespace": ns(client), "token_ids": [1], "text": "x"}},
        {"prefix": {"spec": {**client.spec.model_dump(), "chunk_tokens": 10**9}, "token_ids": [1]}},
        {"all": True, "surprise": 1},
    ]
    for body in bad:
        response = api.post("/v1/evict", json=body)
        assert response.status_code == 422, (body, response.text)
    unknown = api.post("/v1/lookup", json={"namespace": "ab" * 16, "token_ids": [1, 2]})
    assert unknown.status_code == 404 and "not registered" in unknown.json()["detail"]
    no_tokenizer = api.post("/v1/lookup", json={"namespace": ns(client), "text": "hello"})
    assert no_tokenizer.status_code == 422 and "send token_ids" in no_tokenizer.json()["detail"]
    assert api.post("/v1/pin", json={"keys": ["00" * 16], "ttl_s": -1}).status_code == 422
    assert api.post("/v1/lookup", content=b"{not json").status_code == 422


def test_namespaces_another_version_wrote_are_skipped_not_an_error(api, client, daemon):
    """A rolling upgrade: namespace records of a shape this version does not know, or damaged ones, are left out
    of the listing and of a client's attach, and the usage counters of such a namespace too."""
    config = fetch_config(daemon.url)
    raw, keys = redis.Redis.from_url(index_url(config)), Keyspace(config.key_prefix)
    records = {"ab" * 16: json.dumps({"future": {"shape": 2}, "model": "test-model"}), "cd" * 16: "{not json"}
    try:
        raw.hset(keys.namespaces, mapping=records)
        raw.hset(Keyspace.usage(keys.root), mapping={"zz-not-hex:chunks": 3, f"{'ab' * 16}:chunks": "many"})
        response = api.get("/v1/namespaces")
        assert response.status_code == 200
        assert [info["spec"]["model"] for info in response.json()] == ["test-model"]
        other = CacheClient.connect(daemon.url, make_spec(chunk_tokens=32), arena_bytes=16 << 20)
        try:
            assert other.namespace_check is not None and not other.namespace_check.known
        finally:
            other.close()
        assert api.get("/v1/stats").status_code == 200
    finally:
        raw.hdel(keys.namespaces, *records)
        raw.hdel(Keyspace.usage(keys.root), "zz-not-hex:chunks", f"{'ab' * 16}:chunks")
