"""Longest-prefix lookup latency, hashing included, against a real redis-server.

For prompts of 4k, 32k and 128k tokens with every chunk cached (full) or the first half (half), it
times what a scheduler does per new request: pack and hash the tokens, then look up. Two inputs:
a Python list (``p50_ms``/``p99_ms``: includes converting it, paid once per request since the
hasher keeps the packed tokens), and tokens already held as a uint32
array (``array_*``: hashing and lookup only). The naive anchor, measured in the same run on the same
server, is one EXISTS per chunk in sequence (what LMCache's Redis backend does), plus the floor: a
bare PING round trip.

Bursts: N requests of 4k tokens, all cached, added to vLLM together and scheduled in one pass. The scheduler
thread's time for them, looked up one by one (one round trip each) against ``BatchedLookups``
(connector/lookups.py: hashed as vLLM adds them, then looked up together at the pass's first lookup). Rounds
alternate the two ways. Run: ``python -m benchmarks.lookup``.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import redis

from benchmarks.common import percentile_ms, print_table, write_results
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.connector.lookups import BatchedLookups
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import ChunkRecord, Location
from prefixcache.indexer.keys import PrefixHasher
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex
from prefixcache.indexer.tokens import TOKEN_BYTES, pack_tokens

CHUNK_TOKENS = 256
PROMPTS = {4096: 2000, 32768: 1000, 131072: 300}  # tokens -> lookups timed
BURSTS = (1, 8, 32, 64)  # requests added together
BURST_TOKENS, BURST_ROUNDS = 4096, 40


class RoundTripCounter:
    """Counts commands sent to Redis (each a round trip: the client waits for every reply)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = redis.connection.AbstractConnection.send_packed_command

    def __enter__(self) -> RoundTripCounter:
        original = self._original

        caller = threading.get_ident()

        def counting(conn, command, check_health=True):
            if threading.get_ident() == caller:  # not the index's background statistics thread
                self.count += 1
            return original(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counting
        return self

    def __exit__(self, *exc: object) -> None:
        redis.connection.AbstractConnection.send_packed_command = self._original


def chain_records(spec: NamespaceSpec, packed: bytes) -> list[ChunkRecord]:
    """The records of one prompt's chunks (``packed`` tokens; a shorter tail chunk too), as a producer registers
    them: 2 MiB each, in this node's DRAM."""
    parent, records = spec.root(), []
    step = CHUNK_TOKENS * TOKEN_BYTES
    for start in range(0, len(packed), step):
        record = ChunkRecord.of(
            parent=parent,
            packed_tokens=packed[start : start + step],
            root=spec.root(),
            namespace=spec.digest,
            size_bytes=2 << 20,
            location=Location("dram", "bench"),
        )
        records.append(record)
        parent = record.key
    return records


def publish(index: RedisIndex, spec: NamespaceSpec, tokens: list[int]) -> None:
    index.register(chain_records(spec, pack_tokens(tokens)))


def timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    samples, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return samples, result


def burst_case(index: RedisIndex, spec: NamespaceSpec, geometry: ChunkGeometry, prompts: list[list[int]]) -> dict:
    """One burst of ``prompts``, every one cached: the scheduler thread's time one by one and batched."""

    def hashed(prompt: list[int]) -> list:
        return [PrefixHasher(spec.root(), geometry).extend(prompt).query()]

    def one_by_one() -> tuple[float, float]:
        started = time.perf_counter()
        for prompt in prompts:
            assert index.lookup_many(hashed(prompt))[0].matched_tokens == len(prompt)
        return 0.0, time.perf_counter() - started

    def batched() -> tuple[float, float]:
        lookups = BatchedLookups(index)
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            lookups.note(str(i), len(prompt), hashed(prompt))
        added = time.perf_counter()
        for i, prompt in enumerate(prompts):
            (match,), _ = lookups.matches(str(i), len(prompt), lambda: [])
            assert match.matched_tokens == len(prompt)
        return added - started, time.perf_counter() - added

    ways = {"one by one": one_by_one, "batched": batched}
    samples: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for round_ in range(BURST_ROUNDS):
        for way in sorted(ways, reverse=round_ % 2 == 1):  # each goes first in turn
            samples[way].append(ways[way]())
    with RoundTripCounter() as trips:
        batched()
    case: dict[str, object] = {"requests": len(prompts), "tokens": BURST_TOKENS, "batched_round_trips": trips.count}
    for way, name in (("one by one", "one_by_one"), ("batched", "batched")):
        case[f"{name}_added_ms"] = percentile_ms([added for added, _ in samples[way]], 50)
        case[f"{name}_pass_ms"] = percentile_ms([scheduled for _, scheduled in samples[way]], 50)
        case[f"{name}_total_ms"] = percentile_ms([added + scheduled for added, scheduled in samples[way]], 50)
    return case


def burst_row(case: dict) -> list[object]:
    ratio = "{:.2f}".format
    return [
        case["requests"],
        case["one_by_one_pass_ms"],
        case["batched_added_ms"],
        case["batched_pass_ms"],
        case["batched_round_trips"],
        ratio(case["batched_pass_ms"] / case["one_by_one_pass_ms"]),
        ratio(case["batched_total_ms"] / case["one_by_one_total_ms"]),
    ]


def main() -> None:
    geometry = ChunkGeometry(CHUNK_TOKENS)
    spec = NamespaceSpec(
        model="bench", model_fingerprint="b", kv_dtype="bfloat16", kv_layout="chunk-v1", chunk_tokens=CHUNK_TOKENS
    )
    rng = random.Random(0)
    cases, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            index = RedisIndex(server.url)
            raw = redis.Redis.from_url(server.url)
            for tokens_n, repeats in PROMPTS.items():
                for hit in ("full", "half"):
                    index.flush()
                    prompt = [rng.randrange(32000) for _ in range(tokens_n)]
                    publish(index, spec, prompt if hit == "full" else prompt[: tokens_n // 2])

                    def ours(prompt=prompt):
                        return index.lookup(PrefixHasher(spec.root(), geometry).extend(prompt).query())

                    packed = array("I", prompt)

                    def ours_array(packed=packed):
                        return index.lookup(PrefixHasher(spec.root(), geometry).extend(packed).query())

                    def naive(prompt=prompt):
                        keys = PrefixHasher(spec.root(), geometry).extend(prompt).keys
                        hits = 0
                        for key in keys:
                            if not raw.exists(f"pc:e:{key.hex()}"):
                                break
                            hits += 1
                        return hits

                    timed(ours, 20)  # warm-up: script load, allocator
                    samples, match = timed(ours, repeats)
                    array_samples, _ = timed(ours_array, repeats)
                    ping_samples, _ = timed(raw.ping, repeats)
                    naive_samples, naive_hits = timed(naive, max(50, repeats // 10))
                    expected = tokens_n if hit == "full" else tokens_n // 2
                    assert match.matched_tokens == expected, (match.matched_tokens, expected)
                    assert naive_hits * CHUNK_TOKENS == expected
                    with RoundTripCounter() as ours_trips:
                        ours()
                    with RoundTripCounter() as naive_trips:
                        naive()
                    case = {
                        "tokens": tokens_n,
                        "hit": hit,
                        "p50_ms": percentile_ms(samples, 50),
                        "p99_ms": percentile_ms(samples, 99),
                        "array_p50_ms": percentile_ms(array_samples, 50),
                        "array_p99_ms": percentile_ms(array_samples, 99),
                        "round_trips": ours_trips.count,
                        "naive_p50_ms": percentile_ms(naive_samples, 50),
                        "naive_p99_ms": percentile_ms(naive_samples, 99),
                        "naive_round_trips": naive_trips.count,
                        "ping_p50_ms": percentile_ms(ping_samples, 50),
                    }
                    cases.append(case)
                    rows.append(
                        [
                            tokens_n,
                            hit,
                            case["p50_ms"],
                            case["p99_ms"],
                            case["array_p50_ms"],
                            case["array_p99_ms"],
                            case["round_trips"],
                            case["naive_p99_ms"],
                            case["naive_round_trips"],
                            f"{case['naive_p99_ms'] / case['p99_ms']:.1f}x",
                            case["ping_p50_ms"],
                        ]
                    )
            index.flush()
            prompts = [[rng.randrange(32000) for _ in range(BURST_TOKENS)] for _ in range(max(BURSTS))]
            for prompt in prompts:
                publish(index, spec, prompt)
            bursts = [burst_case(index, spec, geometry, prompts[:n]) for n in BURSTS]
            index.close()
        finally:
            server.stop()
    print_table(
        f"Longest-prefix lookup incl. hashing, ms; chunk={CHUNK_TOKENS} tokens; Redis on loopback",
        [
            "tokens",
            "hit",
            "p50",
            "p99",
            "array p50",
            "array p99",
            "trips",
            "naive p99",
            "naive trips",
            "naive/ours",
            "PING p50",
        ],
        rows,
    )
    print_table(
        f"A burst of {BURST_TOKENS}-token requests, all cached: the scheduler thread's ms, medians of {BURST_ROUNDS}",
        [
            "requests",
            "one by one: pass",
            "batched: as added",
            "batched: pass",
            "batched trips",
            "pass ratio",
            "total ratio",
        ],
        [burst_row(burst) for burst in bursts],
    )
    path = write_results("lookup", {"chunk_tokens": CHUNK_TOKENS, "cases": cases, "bursts": bursts})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
