"""Longest-prefix lookup latency, hashing included, against a real redis-server.

For prompts of 4k, 32k and 128k tokens with every chunk cached (full) or the first half (half), it
times what a scheduler does per new request: pack and hash the tokens, then look up. Two inputs:
a Python list (``p50_ms``/``p99_ms``: includes converting it, 0.25 ms per 32k tokens here, paid
once per request since the hasher keeps the packed tokens), and tokens already held as a uint32
array (``array_*``: hashing and lookup only). The naive anchor, measured in the same run on the same
server, is one EXISTS per chunk in sequence (what LMCache's Redis backend does), plus the floor: a
bare PING round trip. Run: ``python -m benchmarks.lookup``.
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
from cachestore.redis_server import EmbeddedRedis
from indexer.chunking import ChunkGeometry
from indexer.index import ChunkRecord, Location
from indexer.keys import PrefixHasher
from indexer.namespace import NamespaceSpec
from indexer.redis_index import RedisIndex
from indexer.tokens import TOKEN_BYTES, pack_tokens

CHUNK_TOKENS = 256
PROMPTS = {4096: 2000, 32768: 1000, 131072: 300}  # tokens -> lookups timed


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


def publish(index: RedisIndex, spec: NamespaceSpec, tokens: list[int]) -> None:
    packed, parent, records = pack_tokens(tokens), spec.root(), []
    step = CHUNK_TOKENS * TOKEN_BYTES
    for start in range(0, len(packed), step):
        record = ChunkRecord.of(
            parent=parent, packed_tokens=packed[start : start + step], root=spec.root(), namespace=spec.digest,
            size_bytes=2 << 20, location=Location("dram", "bench"),
        )  # fmt: skip
        records.append(record)
        parent = record.key
    index.register(records)


def timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    samples, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return samples, result


def main() -> None:
    geometry = ChunkGeometry(CHUNK_TOKENS)
    spec = NamespaceSpec(model="bench", model_fingerprint="b", kv_dtype="bfloat16", kv_layout="chunk-v1",
                         chunk_tokens=CHUNK_TOKENS)  # fmt: skip
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
                        [tokens_n, hit, case["p50_ms"], case["p99_ms"], case["array_p50_ms"], case["array_p99_ms"],
                         case["round_trips"], case["naive_p99_ms"], case["naive_round_trips"],
                         f"{case['naive_p99_ms'] / case['p99_ms']:.1f}x", case["ping_p50_ms"]]
                    )  # fmt: skip
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
    path = write_results("lookup", {"chunk_tokens": CHUNK_TOKENS, "cases": cases})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
