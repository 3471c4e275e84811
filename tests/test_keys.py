"""Keys are the contract between every process that ever shares the cache: pin them down."""

import json
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from prefixcache.indexer.chunking import PROBE_TOKENS, ChunkGeometry
from prefixcache.indexer.errors import ConfigError, InvalidTokensError
from prefixcache.indexer.keys import PrefixHasher, chunk_key, extend_all, media_parent, probe_of, prompt_query
from prefixcache.indexer.namespace import NamespaceSpec, tenant_id
from prefixcache.indexer.tokens import pack_tokens

GOLDEN_SPEC = NamespaceSpec(
    model="golden/model",
    model_fingerprint="0123456789abcdef",
    kv_dtype="bfloat16",
    kv_layout="chunk-v1",
    chunk_tokens=16,
    tp_rank=1,
    tp_size=2,
)
GOLDEN_TOKENS = list(range(40))


def test_golden_namespace_digest():
    # A change here moves every namespace: every deployed cache goes cold. Bump KEY_SCHEME_VERSION on purpose.
    assert GOLDEN_SPEC.canonical_json() == (
        '{"chunk_tokens":16,"key_scheme":1,"kv_dtype":"bfloat16","kv_layout":"chunk-v1",'
        '"model":"golden/model","model_fingerprint":"0123456789abcdef","pp_rank":0,"pp_size":1,'
        '"tp_rank":1,"tp_size":2}'
    )
    assert GOLDEN_SPEC.digest.hex() == "165654c619e026832b4e64c5db3b798b"
    assert GOLDEN_SPEC.root("tenant-a").hex() == "0054314106fefd367ee46c14d1449954"
    # a request variant (connector/request_identity.py) after the tenant: xxh3_128(root ‖ "\0variant\0" ‖ variant)
    assert GOLDEN_SPEC.root("tenant-a", b'[["lora","sql","",""]]').hex() == "15f782a86bba731c43290996c32e6f40"


def test_golden_chunk_keys():
    hasher = PrefixHasher(GOLDEN_SPEC.root(), ChunkGeometry(16)).extend(GOLDEN_TOKENS)
    assert [k.hex() for k in hasher.keys] == ["9a502c39b0f63574b7d706973c248fd5", "747c50ed1fd8ae617bac24e76d75d5ce"]
    assert hasher.tail_key().hex() == "5cf48151df63af6dca9261cc2270fac1"


def test_keys_follow_the_documented_chain():
    root = GOLDEN_SPEC.root()
    packed = pack_tokens(GOLDEN_TOKENS)
    k0 = chunk_key(root, packed[:64])
    k1 = chunk_key(k0, packed[64:128])
    assert k0 == xxhash.xxh3_128_digest(root + struct.pack("<16I", *range(16)))
    hasher = PrefixHasher(root, ChunkGeometry(16)).extend(GOLDEN_TOKENS)
    assert hasher.keys == [k0, k1]
    assert hasher.tail_key() == chunk_key(k1, packed[128:])


def test_incremental_hashing_equals_one_shot():
    tokens = list(range(1000))
    one_shot = PrefixHasher(GOLDEN_SPEC.root(), ChunkGeometry(64)).extend(tokens)
    grown = PrefixHasher(GOLDEN_SPEC.root(), ChunkGeometry(64))
    for start in range(0, 1000, 37):
        grown.extend(tokens[start : start + 37])
    assert grown.keys == one_shot.keys
    assert grown.tail_key() == one_shot.tail_key()
    assert [grown.probe(i) for i in range(17)] == [one_shot.probe(i) for i in range(17)]


def test_media_key_the_chunks_from_the_one_they_begin_in():
    """Text before the first item keeps its keys; from the item's chunk on, other media give other keys."""
    root, geometry, tokens = GOLDEN_SPEC.root(), ChunkGeometry(64), list(range(300))
    packed = pack_tokens(tokens)
    text = PrefixHasher(root, geometry).extend(tokens)
    cat, dog = (PrefixHasher(root, geometry, {2: item}).extend(tokens) for item in (b"cat", b"dog"))
    assert cat.keys[:2] == dog.keys[:2] == text.keys[:2]
    assert len({text.keys[2], cat.keys[2], dog.keys[2]}) == 3 and len({text.keys[3], cat.keys[3], dog.keys[3]}) == 3
    assert cat.keys[2] == chunk_key(media_parent(cat.keys[1], b"cat"), packed[2 * 256 : 3 * 256])
    assert cat.keys[3] == chunk_key(cat.keys[2], packed[3 * 256 : 4 * 256])  # the chain carries the item
    assert cat.tail_key() != text.tail_key()
    assert cat.query().probes[:2] == text.query().probes[:2] and cat.query().probes[2] != text.query().probes[2]
    assert cat.query().parent(2) == media_parent(cat.keys[1], b"cat") == cat.parent(2)
    in_tail = PrefixHasher(root, geometry, {4: b"cat"}).extend(tokens)
    assert in_tail.keys == text.keys and in_tail.tail_key() != text.tail_key()
    grown = PrefixHasher(root, geometry, {2: b"cat"})
    for start in range(0, 300, 37):
        grown.extend(tokens[start : start + 37])
    assert grown.keys == cat.keys and grown.tail_key() == cat.tail_key()


def test_probe_is_the_key_of_the_first_probe_tokens():
    root = GOLDEN_SPEC.root()
    tokens = list(range(100))
    query = prompt_query(root, ChunkGeometry(64), tokens)
    assert query.probes[0] == chunk_key(root, pack_tokens(tokens[:PROBE_TOKENS]))
    assert query.probes[1] == probe_of(query.keys[0], pack_tokens(tokens[64:]))
    assert prompt_query(root, ChunkGeometry(64), tokens[:70]).probes[1] is None  # only 6 tokens follow chunk 0


def test_tenant_salt_separates_key_spaces_and_is_never_exposed():
    assert GOLDEN_SPEC.root("a") != GOLDEN_SPEC.root("b") != GOLDEN_SPEC.root()
    assert "secret-salt" not in tenant_id("secret-salt")
    assert tenant_id(None) == ""


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"model_fingerprint": "beef"},
        {"kv_dtype": "float16"},
        {"kv_layout": "chunk-v2"},
        {"chunk_tokens": 32},
        {"tp_rank": 0},
        {"tp_size": 4},
        {"pp_rank": 1},
        {"pp_size": 2},
    ],
)
def test_every_field_changes_the_namespace(change):
    assert GOLDEN_SPEC.model_copy(update=change).digest != GOLDEN_SPEC.digest


def test_each_rank_of_a_parallel_engine_has_a_namespace_of_its_own_in_shard_order():
    engine = GOLDEN_SPEC.model_copy(update={"tp_rank": 0, "tp_size": 2, "pp_size": 3})
    shards = engine.shards()
    assert [(s.pp_rank, s.tp_rank) for s in shards] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [s.shard for s in shards] == list(range(6)) and shards[0] == engine
    assert len({s.digest for s in shards}) == 6
    assert shards[3].shards() == shards  # any rank names them all


_CHILD = """
import json, sys
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.keys import PrefixHasher
from prefixcache.indexer.namespace import NamespaceSpec
spec = NamespaceSpec.model_validate_json(sys.argv[1])
h = PrefixHasher(spec.root("t"), ChunkGeometry(16)).extend(list(range(40)))
print(json.dumps([k.hex() for k in h.keys] + [h.tail_key().hex(), spec.digest.hex()]))
"""


def test_keys_are_identical_across_processes_and_hash_seeds(repo_root):
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, GOLDEN_SPEC.model_dump_json()],
            env=env,
            cwd=repo_root,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    here = PrefixHasher(GOLDEN_SPEC.root("t"), ChunkGeometry(16)).extend(list(range(40)))
    assert json.loads(outputs.pop())[:2] == [k.hex() for k in here.keys]


def test_empty_prompt_is_rejected():
    with pytest.raises(InvalidTokensError, match="empty prompt"):
        prompt_query(GOLDEN_SPEC.root(), ChunkGeometry(16), [])


@pytest.mark.parametrize(
    ("chunk", "block", "message"),
    [
        (100, 16, "not a multiple of the engine's KV block size 16; choose e.g. 96"),
        (0, None, "1..65536"),
        (256, 0, "positive integer"),
        (1.5, None, "integer"),
    ],
)
def test_bad_chunk_geometry_is_rejected(chunk, block, message):
    with pytest.raises(ConfigError, match=message):
        ChunkGeometry(chunk, block)


def test_extend_all_gives_each_chain_what_extending_it_alone_gives():
    geometry = ChunkGeometry(64)
    roots = [b"\x01" * 16, b"\x02" * 16]
    tokens = list(range(200))
    chains = [PrefixHasher(root, geometry) for root in roots]
    extend_all(chains, tokens[:100])
    extend_all(chains, tokens[100:])
    assert [c.query() for c in chains] == [prompt_query(root, geometry, tokens) for root in roots]
    with pytest.raises(InvalidTokensError):
        extend_all(chains, [1, -2])
