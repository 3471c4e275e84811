"""What the admin API needs from the index (listing pages, usage, subtrees, backlog), on every backend."""

from __future__ import annotations

import pytest

from prefixcache.indexer.index import Location, Usage, subtree
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.namespace import tenant_id
from prefixcache.indexer.redis_clients import redis_client
from prefixcache.indexer.redis_index import RedisIndex
from tests.test_index import DRAM, NVME, lookup, publish


def test_pages_walk_every_entry_once_in_key_order(index, spec):
    keys = publish(index, spec, list(range(64 * 7)))
    seen, after = [], None
    while page := index.page(after, 3):
        assert len(page) <= 3
        seen += [e.key for e in page]
        after = page[-1].key
    assert seen == sorted(keys)
    assert index.page(max(keys), 10) == []


def test_a_page_skips_removed_entries_and_continues_after_the_cursor(index, spec):
    keys = sorted(publish(index, spec, list(range(64 * 4))))
    first = index.page(None, 2)
    index.remove([keys[2]])
    assert [e.key for e in index.page(first[-1].key, 10)] == [keys[3]]


def test_usage_counts_entries_and_copies_per_tier_through_every_change(index, spec):
    other = spec.model_copy(update={"kv_dtype": "float16"})
    keys = publish(index, spec, list(range(64 * 3)))  # 3 chunks of 1000 bytes in DRAM
    publish(index, other, list(range(64)), NVME)
    usage = index.usage()
    assert usage[spec.digest].entries == Usage(3, 3000) and usage[spec.digest].tiers == {"dram": Usage(3, 3000)}
    assert usage[other.digest].tiers == {"nvme": Usage(1, 1000)}
    index.add_location(keys[:2], NVME)
    publish(index, spec, list(range(64)), Location("dram", "node-b"))  # a second DRAM copy, still one entry
    usage = index.usage()[spec.digest]
    assert usage.entries == Usage(3, 3000)
    assert usage.tiers == {"dram": Usage(4, 4000), "nvme": Usage(2, 2000)}
    index.drop_location(keys[2:], DRAM)  # its last location: the entry goes too
    index.remove(keys[:1])
    usage = index.usage()[spec.digest]
    assert usage.entries == Usage(1, 1000) and usage.tiers == {"dram": Usage(1, 1000), "nvme": Usage(1, 1000)}
    index.remove(keys)
    assert spec.digest not in index.usage()


def test_tenant_usage_counts_each_tenants_entries_over_every_namespace(index, spec):
    other = spec.model_copy(update={"kv_dtype": "float16"})
    a, b = tenant_id("salt-a"), tenant_id("salt-b")
    keys = publish(index, spec, list(range(64 * 3)), tenant="salt-a")
    publish(index, other, list(range(64 * 2)), tenant="salt-a")
    publish(index, spec, list(range(64)), tenant="salt-b")
    publish(index, spec, list(range(64 * 2)))
    publish(index, spec, list(range(64 * 3)), NVME, tenant="salt-a")  # another copy of the same three: no new entry
    assert index.tenant_usage() == {a: Usage(5, 5000), b: Usage(1, 1000), "": Usage(2, 2000)}
    index.remove(keys[:1])
    index.drop_location(keys[1:], DRAM)  # an NVMe copy remains: still counted
    assert index.tenant_usage()[a] == Usage(4, 4000)
    index.drop_location(keys[1:], NVME)
    index.remove(publish(index, spec, list(range(64)), tenant="salt-b"))
    assert index.tenant_usage() == {a: Usage(2, 2000), "": Usage(2, 2000)}


def test_an_inspecting_lookup_leaves_access_statistics_alone(index, spec, geometry):
    keys = publish(index, spec, list(range(128)))
    query = prompt_query(spec.root(), geometry, list(range(128)))
    assert index.lookup(query, touch=False).matched_tokens == 128
    index.flush_access()
    assert [e.hits for e in index.get(keys)] == [0, 0]


def test_subtree_reaches_every_descendant_even_past_a_hole(index, spec):
    keys = publish(index, spec, list(range(64 * 4)))
    branch = publish(index, spec, list(range(64)) + [9] * 80)  # diverges after the first chunk
    index.remove([keys[1]])
    assert set(subtree(index, [keys[0]], limit=100)) == {keys[0], *branch[1:]}
    found = subtree(index, keys, limit=100)  # the whole chain, the removed key included
    assert set(found) == set(keys + branch) and found[:4] == keys
    assert len(subtree(index, [keys[0]], limit=1)) == 1
    assert subtree(index, [b"\x07" * 16], limit=10) == [b"\x07" * 16]


def test_feed_backlog_counts_what_a_group_has_not_acknowledged(index, spec):
    assert index.feed_backlog("node-a", "g") == 0
    publish(index, spec, list(range(64 * 3)))
    assert index.feed_backlog("node-a", "g") == 3
    events = index.read_feed("node-a", "g", "c", count=2)
    index.ack_feed("node-a", "g", [e.id for e in events])
    assert index.feed_backlog("node-a", "g") == 1


def test_lookups_still_hit_after_the_new_bookkeeping(index, spec, geometry):
    publish(index, spec, list(range(100)))
    assert lookup(index, spec, geometry, list(range(100))).matched_tokens == 100


def forget_tenant_counts(index: RedisIndex) -> None:
    """Leave ``index`` as a version that kept no tenant usage filled it: no entry marked counted, no usage."""
    raw = redis_client(index.url)
    for name in raw.scan_iter(match=index.keyspace.everything, count=1000):
        if name.endswith(b":tu"):
            raw.delete(name)
        elif b":e:" in name:
            raw.hdel(name, "counted")
    raw.close()


@pytest.mark.parametrize("deployment", ["redis_index", "cluster_index", "sentinel_index"])
def test_entries_an_earlier_version_registered_join_their_tenants_usage_once(request, deployment, spec):
    index = request.getfixturevalue(deployment)
    a = tenant_id("salt-a")
    old = publish(index, spec, list(range(64 * 4)), tenant="salt-a")
    forget_tenant_counts(index)
    publish(index, spec, list(range(10_000, 10_000 + 64 * 2)), tenant="salt-a")
    assert index.tenant_usage() == {a: Usage(2, 2000)}
    index.remove(old[-1:])  # an entry never counted leaves the usage alone: never below what the tenant holds
    assert index.tenant_usage() == {a: Usage(2, 2000)}
    assert index.count_tenant_usage() == 3
    assert index.tenant_usage() == {a: Usage(5, 5000)}
    assert index.count_tenant_usage() == 0  # again, or beside another caller: each entry is counted once
    index.remove(old[:1])
    assert index.tenant_usage() == {a: Usage(4, 4000)}
