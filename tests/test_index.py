"""Index behaviour, run against both backends (embedded and a real redis-server)."""

from __future__ import annotations

import math
import time

import pytest

from prefixcache.indexer.errors import InvalidTokensError
from prefixcache.indexer.index import ChunkRecord, Location, PrefixIndex, attach_namespace
from prefixcache.indexer.keys import media_parent, prompt_query
from prefixcache.indexer.namespace import NamespaceSpec, tenant_id
from prefixcache.indexer.tokens import TOKEN_BYTES, pack_tokens

DRAM = Location("dram", "node-a")
NVME = Location("nvme", "node-a")


def publish(
    index: PrefixIndex, spec: NamespaceSpec, tokens: list[int], location: Location = DRAM, tenant=None, media=None
):
    """Register every chunk of a prompt (full chunks and the partial tail) the way a producer does."""
    root = spec.root(tenant)
    packed = pack_tokens(tokens)
    step = spec.chunk_tokens * TOKEN_BYTES
    records, parent = [], root
    for start in range(0, len(packed), step):
        record = ChunkRecord.of(
            parent=media_parent(parent, (media or {}).get(start // step)),
            packed_tokens=packed[start : start + step],
            root=root,
            namespace=spec.digest,
            size_bytes=1000,
            location=location,
            tenant=tenant_id(tenant),
        )
        records.append(record)
        parent = record.key
    index.register(records)
    return [r.key for r in records]


def lookup(index, spec, geometry, tokens, tenant=None, media=None):
    return index.lookup(prompt_query(spec.root(tenant), geometry, tokens, media))


def test_empty_index_misses(index, spec, geometry):
    match = lookup(index, spec, geometry, list(range(300)))
    assert match.matched_tokens == 0 and match.keys == [] and match.partial is None


def test_full_hit_includes_the_partial_tail(index, spec, geometry):
    tokens = list(range(300))  # 4 full chunks of 64 + a 44-token tail
    keys = publish(index, spec, tokens)
    match = lookup(index, spec, geometry, tokens)
    assert match.keys == keys[:4]
    assert match.partial is not None and match.partial.key == keys[4] and match.partial.tokens == 44
    assert match.matched_tokens == 300


def test_half_hit_stops_at_the_first_missing_chunk(index, spec, geometry):
    tokens = list(range(512))
    publish(index, spec, tokens[:256])
    match = lookup(index, spec, geometry, tokens)
    assert match.matched_tokens == 256 and len(match.keys) == 4 and match.partial is None


def test_partial_hit_is_token_granular_at_the_divergence(index, spec, geometry):
    stored = list(range(200))
    keys = publish(index, spec, stored)  # chunks [0,64) [64,128) [128,192) and tail [192,200)
    diverging = stored[:150] + [9999] * 100  # shares 22 tokens of the third chunk
    match = lookup(index, spec, geometry, diverging)
    assert match.keys == keys[:2]
    assert match.partial is not None and match.partial.key == keys[2] and match.partial.tokens == 22
    assert match.matched_tokens == 150


def test_prompts_with_other_media_share_only_the_chunks_before_the_first_item(index, spec, geometry):
    tokens = list(range(300))  # chunks [0,64) [64,128) [128,192) [192,256), tail [256,300); an image at 150
    keys = publish(index, spec, tokens, media={2: b"cat"})
    assert lookup(index, spec, geometry, tokens, media={2: b"cat"}).matched_tokens == 300
    for other in ({2: b"dog"}, None, {3: b"cat"}):  # other media, none, the same item elsewhere
        match = lookup(index, spec, geometry, tokens, media=other)
        assert match.keys == keys[:2] and match.partial is None and match.matched_tokens == 128
    diverging = tokens[:150] + [9999] * 150  # the same image, other text after token 150
    match = lookup(index, spec, geometry, diverging, media={2: b"cat"})
    assert match.keys == keys[:2] and match.partial.key == keys[2] and match.matched_tokens == 150


def test_grown_prompt_reuses_the_previous_turns_tail(index, spec, geometry):
    turn1 = list(range(100))  # chunk [0,64) + 36-token tail
    keys = publish(index, spec, turn1)
    turn2 = turn1 + list(range(500, 600))
    match = lookup(index, spec, geometry, turn2)
    assert match.keys == keys[:1] and match.partial.key == keys[1] and match.matched_tokens == 100


def test_lookup_many_answers_each_shards_chain_as_lookup_does(index, spec, geometry):
    """The ranks of a parallel engine keep one chain each (their own namespace); one call looks them all up."""
    other_rank = spec.model_copy(update={"tp_size": 2}).shards()[1]
    tokens = list(range(300))
    publish(index, spec, tokens)
    publish(index, other_rank, tokens[:128])  # this shard has only the first two chunks
    queries = [prompt_query(s.root(), geometry, tokens) for s in (spec, other_rank)]
    matches = index.lookup_many(queries)
    assert matches == [index.lookup(q) for q in queries]
    assert [m.matched_tokens for m in matches] == [300, 128]
    assert index.lookup_many([]) == []


def test_lookup_says_which_hits_have_no_dram_copy(index, spec, geometry):
    """A loader reads those from NVMe at once instead of asking DRAM first."""
    tokens = list(range(256))
    keys = publish(index, spec, tokens, location=NVME)
    index.add_location([keys[1], keys[3]], DRAM)
    index.drop_location([keys[3]], NVME)
    longer = tokens + list(range(5000, 5010))
    match = lookup(index, spec, geometry, longer)
    assert match.keys == keys and match.without_dram == {0, 2}
    index.drop_location([keys[1]], DRAM)
    assert lookup(index, spec, geometry, longer).without_dram == {0, 1, 2}
    assert lookup(index, spec, geometry, list(range(1000, 1300))).without_dram == set()  # a miss


def test_lookup_says_whether_the_partial_chunk_has_a_dram_copy(index, spec, geometry):
    """Its own entry decides, not the chunk before it: a partial on NVMe alone is read from disk at once."""
    tokens = list(range(300))  # 4 full chunks of 64 + a 44-token tail
    keys = publish(index, spec, tokens, location=NVME)
    index.add_location(keys[:4], DRAM)
    match = lookup(index, spec, geometry, tokens)
    assert match.partial.key == keys[4] and not match.partial.in_dram
    assert match.without_dram == set() and match.on_nvme_alone == {4}
    index.add_location([keys[4]], DRAM)
    index.drop_location(keys[:4], DRAM)
    match = lookup(index, spec, geometry, tokens)
    assert match.partial.in_dram and match.on_nvme_alone == {0, 1, 2, 3}


def test_a_lookup_avoiding_nodes_stops_at_the_first_chunk_held_only_there(index, spec, geometry):
    """Chunks whose every copy lies on a down node are misses, and a DRAM copy there is no DRAM copy."""
    tokens = list(range(300))  # 4 full chunks + a 44-token tail, all on node-a's DRAM
    keys = publish(index, spec, tokens)
    other = Location("nvme", "node-b")
    index.add_location(keys[:2], other)
    match = index.lookup(prompt_query(spec.root(), geometry, tokens), avoid={"node-a"})
    assert match.keys == keys[:2] and match.partial is None and match.without_dram == {0, 1}
    assert index.lookup(prompt_query(spec.root(), geometry, tokens), avoid={"node-c"}).matched_tokens == 300
    index.add_location(keys[2:], Location("dram", "node-b"))
    match = index.lookup(prompt_query(spec.root(), geometry, tokens), avoid={"node-a", "node-c"})
    assert match.matched_tokens == 300 and match.without_dram == {0, 1} and match.partial.in_dram
    assert index.lookup(prompt_query(spec.root(), geometry, tokens), avoid={"node-a", "node-b"}).matched_tokens == 0


def test_a_lookup_that_names_its_node_says_which_dram_copies_lie_elsewhere(index, spec, geometry):
    """Those reads cross the network: a loader reads them into slots, with a deadline."""
    tokens = list(range(300))  # 4 full chunks + a 44-token tail, all on node-a's DRAM
    keys = publish(index, spec, tokens)
    index.add_location([keys[1], keys[4]], Location("dram", "node-b"))
    index.add_location([keys[2]], Location("nvme", "node-b"))
    index.drop_location([keys[2]], DRAM)
    query = prompt_query(spec.root(), geometry, tokens)
    on_b = index.lookup(query, here="node-b")
    assert on_b.matched_tokens == 300 and on_b.without_dram == {2} and on_b.remote_dram == {0, 3}
    assert index.lookup(query, here="node-a").remote_dram == set()  # node-a holds a DRAM copy of each
    assert index.lookup(query, here="node-c").remote_dram == {0, 1, 3, 4}
    assert index.lookup(query).remote_dram == set()  # no node named: nothing said


def test_a_lookup_avoiding_nodes_takes_no_partial_chunk_held_only_there(index, spec, geometry):
    stored = list(range(200))
    keys = publish(index, spec, stored)  # chunks [0,64) [64,128) [128,192) and tail [192,200) on node-a
    index.add_location(keys[:2], Location("dram", "node-b"))
    diverging = stored[:150] + [9999] * 100  # shares 22 tokens of the third chunk, which node-a alone holds
    match = index.lookup(prompt_query(spec.root(), geometry, diverging), avoid={"node-a"})
    assert match.keys == keys[:2] and match.partial is None
    assert index.lookup(prompt_query(spec.root(), geometry, diverging)).partial.key == keys[2]


def test_fewer_than_probe_tokens_shared_is_not_a_partial_hit(index, spec, geometry):
    publish(index, spec, list(range(128)))
    match = lookup(index, spec, geometry, list(range(64)) + list(range(64, 74)) + [7777] * 60)
    assert match.matched_tokens == 64 and match.partial is None


def test_lookup_refreshes_access_time_and_hits_of_the_hits(index, spec, geometry):
    keys = publish(index, spec, list(range(128)))
    before = index.get(keys)
    time.sleep(0.01)
    lookup(index, spec, geometry, list(range(64)) + [5] * 64)
    index.flush_access()
    first, second = index.get(keys)
    assert first.hits == 1 and first.last_access_s > before[0].last_access_s
    assert second.hits == 0


def test_a_lookup_that_did_not_touch_counts_once_its_match_is_touched(index, spec, geometry):
    keys = publish(index, spec, list(range(128)))
    before = index.get(keys)
    time.sleep(0.01)
    (match,) = index.lookup_many([prompt_query(spec.root(), geometry, list(range(64)) + [5] * 64)], touch=False)
    index.flush_access()
    assert [entry.hits for entry in index.get(keys)] == [0, 0]
    index.touch([match])
    index.flush_access()
    first, second = index.get(keys)
    assert first.hits == 1 and first.last_access_s > before[0].last_access_s
    assert second.hits == 0


def test_other_namespace_and_other_tenant_get_zero_hits(index, spec, geometry):
    tokens = list(range(256))
    publish(index, spec, tokens, tenant="tenant-a")
    assert lookup(index, spec, geometry, tokens, tenant="tenant-a").matched_tokens == 256
    assert lookup(index, spec, geometry, tokens, tenant="tenant-b").matched_tokens == 0
    assert lookup(index, spec, geometry, tokens).matched_tokens == 0
    other = spec.model_copy(update={"kv_dtype": "float16"})
    assert lookup(index, other, geometry, tokens, tenant="tenant-a").matched_tokens == 0


def test_two_writers_of_one_chunk_leave_one_entry_with_both_locations(index, spec):
    tokens = list(range(64))
    (key,) = publish(index, spec, tokens, DRAM)
    first = index.get([key])[0]
    publish(index, spec, tokens, Location("dram", "node-b"))
    (entry,) = index.get([key])
    assert entry.locations == {DRAM, Location("dram", "node-b")}
    assert entry.created_s == first.created_s
    assert sum(1 for e in index.scan() if e.key == key) == 1


def test_entry_metadata_round_trips(index, spec):
    (key, tail) = publish(index, spec, list(range(100)), tenant="t1")
    entry = index.get([tail])[0]
    assert entry.parent == key and entry.root == spec.root("t1") and entry.namespace == spec.digest
    assert entry.num_tokens == 36 and entry.size_bytes == 1000 and entry.locations == {DRAM}
    assert entry.tenant == tenant_id("t1") and not entry.pinned(index.clock_s())
    assert index.get([b"\x00" * 16]) == [None]


def test_dropping_the_last_location_removes_the_entry_and_its_bucket(index, spec, geometry):
    tokens = list(range(100))
    keys = publish(index, spec, tokens)
    assert index.add_location(keys + [b"\x01" * 16], NVME) == [b"\x01" * 16]
    assert index.drop_location(keys, DRAM) == []  # NVMe copies remain
    assert index.get(keys)[1].locations == {NVME}
    assert index.drop_location(keys[1:], NVME) == keys[1:]
    assert index.get(keys)[1] is None
    match = lookup(index, spec, geometry, tokens)
    assert match.matched_tokens == 64 and match.partial is None


def test_remove_and_children(index, spec, geometry):
    keys = publish(index, spec, list(range(192)))
    sibling = publish(index, spec, list(range(64)) + [42] * 64)[1]
    assert index.children(keys[0]) == sorted([keys[1], sibling])
    assert index.remove([keys[1], b"\x02" * 16]) == 1
    assert index.children(keys[0]) == [sibling]
    assert lookup(index, spec, geometry, list(range(192))).matched_tokens == 64


def test_pin_until_and_unpin(index, spec):
    keys = publish(index, spec, list(range(128)))
    assert index.set_pin(keys + [b"\x03" * 16], math.inf) == 2
    assert all(e.pinned(index.clock_s()) for e in index.get(keys))
    index.set_pin(keys[:1], index.clock_s() + 0.05)
    first = index.get(keys[:1])[0]
    assert first.pinned(index.clock_s()) and not first.pinned(index.clock_s() + 1)
    index.set_pin(keys, 0)
    assert not any(e.pinned(index.clock_s()) for e in index.get(keys))


def test_scan_lists_every_entry(index, spec):
    keys = publish(index, spec, list(range(64 * 5)))
    assert sorted(e.key for e in index.scan(batch=2)) == sorted(keys)


def test_namespace_registry_names_the_fields_that_differ(index, spec, caplog):
    first = index.register_namespace(spec)
    assert not first.known and first.conflicts == []
    assert index.register_namespace(spec).known
    other_tp = spec.model_copy(update={"tp_size": 2, "kv_dtype": "float16"})
    check = index.register_namespace(other_tp)
    assert not check.known
    assert check.mismatches() == {spec.digest.hex(): {"kv_dtype": ("float16", "bfloat16"), "tp_size": (2, 1)}}
    unrelated = spec.model_copy(update={"model": "other", "model_fingerprint": "0" * 32})
    assert index.register_namespace(unrelated).conflicts == []
    assert {s.digest for s in index.namespaces()} == {spec.digest, other_tp.digest, unrelated.digest}


def test_attaching_a_mismatched_namespace_logs_the_differing_fields(index, spec, caplog):
    attach_namespace(index, spec)
    assert caplog.records == []
    attach_namespace(index, spec.model_copy(update={"chunk_tokens": 128}))
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert "chunk_tokens: ours=128 theirs=64" in record.getMessage()
    assert spec.digest.hex()[:12] in record.getMessage()


def test_lookup_of_bad_input(index, spec, geometry):
    with pytest.raises(InvalidTokensError):
        lookup(index, spec, geometry, [])
    with pytest.raises(InvalidTokensError):
        lookup(index, spec, geometry, [1, None, 3])


def test_a_chain_with_a_hole_hits_only_up_to_the_hole(index, spec, geometry):
    tokens = list(range(64 * 6))
    keys = publish(index, spec, tokens)
    index.remove([keys[2]])  # chunks 3..5 remain but are unreachable past the hole
    assert lookup(index, spec, geometry, tokens).keys == keys[:2]
    index.remove([keys[0]])
    assert lookup(index, spec, geometry, tokens).matched_tokens == 0


def feed_ops(index, node="node-a", group="g"):
    return [(e.op, str(e.location), e.key) for e in index.read_feed(node, group, "c1")]


def test_the_change_feed_reports_every_location_added_and_dropped(index, spec):
    keys = publish(index, spec, list(range(128)))
    publish(index, spec, list(range(128)))  # same chunks, same location: no new events
    assert feed_ops(index) == [("add", "dram@node-a", k) for k in keys]
    index.add_location(keys[:1], NVME)
    index.drop_location(keys[:1], DRAM)
    index.remove(keys)
    assert feed_ops(index) == [
        ("add", "nvme@node-a", keys[0]),
        ("drop", "dram@node-a", keys[0]),
        ("drop", "nvme@node-a", keys[0]),
        ("drop", "dram@node-a", keys[1]),
    ]
    assert feed_ops(index, node="node-b") == []


def test_each_consumer_group_reads_the_feed_independently(index, spec):
    keys = publish(index, spec, list(range(64)))
    assert [e.key for e in index.read_feed("node-a", "persist", "c")] == keys
    assert [e.key for e in index.read_feed("node-a", "events", "c")] == keys
    assert index.read_feed("node-a", "persist", "c") == []


def test_a_blocking_feed_read_waits_for_new_events(index, spec):
    assert index.read_feed("node-a", "g", "c", block_s=0.01) == []
    publish(index, spec, list(range(64)))
    assert len(index.read_feed("node-a", "g", "c", block_s=1)) == 1
