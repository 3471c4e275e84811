"""What the index costs one Redis as it grows, and what Redis Cluster would see of its keys.

Against a redis-server of its own (a free port, as the daemon configures it: AOF on) it measures:

1. Redis memory per stored chunk: ``INFO memory`` used_memory before and after registering
   ``--memory-chunks`` chunks of 256 tokens (token ids kept in the probe bucket as the index stores them,
   one DRAM location each, so one change-feed entry each), divided by their number.
2. Longest-prefix lookup latency, p50/p99, of a cached 16-chunk prompt once the index holds 10k, then
   ``--chunks`` chunks. Queries are hashed beforehand (hashing is timed on its own) and lookups skip the
   access-time update, which the client batches in the background.

   Every chunk is registered by the index's own register script, so each is a full, valid entry; to fill
   fast, the calls (thousands of records each) are pipelined rather than awaited one by one as
   ``RedisIndex.register`` does, and the prompts are chains of 64 chunks of token ids drawn with numpy.
3. Lookups per second from N concurrent clients (processes, one connection each), and what predicts a
   cluster's throughput: Redis CPU time per lookup (``INFO cpu`` user+sys delta over the lookups),
   commands Redis ran per lookup (``INFO commandstats``) and round trips per lookup, counted client-side.
4. Hash slots (CRC16 mod 16384, as Redis Cluster places keys) of the keys one lookup reads, for 64
   prompts with different first chunks, spread over 3 equal slot ranges: today's keys carry no
   ``{hash tag}``, so one chain's keys land on several shards and the one-script lookup cannot run on
   Cluster ("shards touched per lookup").

Every row names its deployment ("single Redis"), so a cluster's rows can join the same tables.
Run: ``python -m benchmarks.index_scale`` (``--chunks``, ``--memory-chunks``, ``--seconds`` shrink it; any
flag off its default writes ``index_scale.partial.json``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import redis
from redis.crc import key_slot

from benchmarks.common import percentile_ms, print_table, with_defaults, write_results
from benchmarks.lookup import CHUNK_TOKENS, RoundTripCounter, chain_records
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import ChunkRecord, Location
from prefixcache.indexer.keys import PrefixHasher, PrefixQuery
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex, load_script, register_args

PROMPT_CHUNKS = 16  # the cached prompt looked up: 4096 tokens
FILL_CHAIN = 64  # chunks per synthetic chain
BATCH = 2000  # records per register call
PIPELINE = 8  # register calls per pipeline
SMALL_INDEX = 10_000
LATENCY_LOOKUPS = 5000
CLIENTS = (1, 2, 4, 8)
SLOT_PROMPTS, SHARDS, SLOTS = 64, 3, 16384
DEPLOYMENT = "single Redis"
LOCATION = Location("dram", "bench")


def spec() -> NamespaceSpec:
    return NamespaceSpec(
        model="bench", model_fingerprint="b", kv_dtype="bfloat16", kv_layout="chunk-v1", chunk_tokens=CHUNK_TOKENS
    )


def full_chunk_records(ns: NamespaceSpec, tokens: np.ndarray) -> list[ChunkRecord]:
    """The records of a prompt of whole chunks (``tokens``: a multiple of ``CHUNK_TOKENS``)."""
    return chain_records(ns, tokens.astype("<u4").tobytes())


def synthetic_records(ns: NamespaceSpec, count: int, seed: int) -> Iterator[list[ChunkRecord]]:
    """``count`` chunks of random prompts, ``FILL_CHAIN`` chunks a prompt, in batches of about ``BATCH``."""
    rng = np.random.default_rng(seed)
    batch: list[ChunkRecord] = []
    while count > 0:
        chunks = min(FILL_CHAIN, count)
        batch += full_chunk_records(ns, rng.integers(0, 32000, chunks * CHUNK_TOKENS, dtype=np.uint32))
        count -= chunks
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def fill(raw: redis.Redis, ns: NamespaceSpec, count: int, seed: int) -> float:
    """Register ``count`` synthetic chunks with the index's register script, ``PIPELINE`` calls per round trip
    (``RedisIndex.register`` awaits each); returns the seconds taken."""
    started = time.perf_counter()
    script, pipe = load_script(raw, "register"), raw.pipeline(transaction=False)
    for queued, records in enumerate(synthetic_records(ns, count, seed), start=1):
        script(args=register_args("pc:", records), client=pipe)
        if queued % PIPELINE == 0:
            pipe.execute()
    pipe.execute()
    return time.perf_counter() - started


def cpu_s(raw: redis.Redis) -> float:
    info = raw.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def commands(raw: redis.Redis) -> int:
    """Commands Redis has run, those inside scripts included, less INFO (this benchmark's own)."""
    stats = raw.info("commandstats")
    return sum(int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info")


def prompt_query(ns: NamespaceSpec, seed: int) -> tuple[np.ndarray, PrefixQuery]:
    tokens = np.random.default_rng(seed).integers(0, 32000, PROMPT_CHUNKS * CHUNK_TOKENS, dtype=np.uint32)
    return tokens, PrefixHasher(ns.root(), ChunkGeometry(CHUNK_TOKENS)).extend(tokens).query()


def latency(index: RedisIndex, query: PrefixQuery, indexed: int) -> dict:
    for _ in range(1000):  # warm-up
        index.lookup(query, touch=False)
    samples = []
    for _ in range(LATENCY_LOOKUPS):
        start = time.perf_counter()
        match = index.lookup(query, touch=False)
        samples.append(time.perf_counter() - start)
    assert len(match.keys) == PROMPT_CHUNKS, len(match.keys)
    return {
        "deployment": DEPLOYMENT,
        "indexed_chunks": indexed,
        "p50_ms": percentile_ms(samples, 50),
        "p99_ms": percentile_ms(samples, 99),
    }


def hashing_ms(tokens: np.ndarray) -> dict:
    geometry, root, samples = ChunkGeometry(CHUNK_TOKENS), spec().root(), []
    for _ in range(LATENCY_LOOKUPS):
        start = time.perf_counter()
        PrefixHasher(root, geometry).extend(tokens).query()
        samples.append(time.perf_counter() - start)
    return {"p50_ms": percentile_ms(samples, 50), "p99_ms": percentile_ms(samples, 99)}


def client(url: str, seed: int, seconds: float, start, counts) -> None:
    """One concurrent client: its own connection, the same cached prompt, lookups for ``seconds``."""
    index = RedisIndex(url)
    _, query = prompt_query(spec(), seed)
    index.lookup(query, touch=False)
    start.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        index.lookup(query, touch=False)
        done += 1
    counts.put(done)
    index.close()


def throughput(url: str, raw: redis.Redis, seed: int, clients: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    start, counts = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=client, args=(url, seed, seconds, start, counts)) for _ in range(clients)]
    for worker in workers:
        worker.start()
    time.sleep(2.0 + 0.3 * clients)  # every client connected and warm (each looks up once first)
    cpu_before, commands_before = cpu_s(raw), commands(raw)
    started = time.perf_counter()
    start.set()
    lookups = sum(counts.get(timeout=seconds + 60) for _ in workers)
    wall = time.perf_counter() - started
    cpu, ran = cpu_s(raw) - cpu_before, commands(raw) - commands_before
    for worker in workers:
        worker.join()
    return {
        "deployment": DEPLOYMENT,
        "clients": clients,
        "lookups": lookups,
        "lookups_per_s": lookups / wall,
        "redis_cpu_us_per_lookup": cpu / lookups * 1e6,
        "redis_cpu_share": cpu / wall,  # of one core
        "commands_per_lookup": ran / lookups,
    }


def shard_of(key: str) -> int:
    """The shard holding ``key`` when 16384 slots are split into ``SHARDS`` equal ranges."""
    return key_slot(key.encode()) * SHARDS // SLOTS


def slot_spread(ns: NamespaceSpec) -> dict:
    """Shards a lookup (and a register) of each of ``SLOT_PROMPTS`` prompts would touch, and how the keys of
    their lookups spread."""
    lookups, registers, per_shard = [], [], [0] * SHARDS
    for seed in range(SLOT_PROMPTS):
        records = full_chunk_records(ns, prompt_query(ns, 10_000 + seed)[0])
        read = [f"pc:e:{r.key.hex()}" for r in records]  # a full hit reads no probe bucket
        written = read + [f"pc:k:{r.parent.hex()}" for r in records] + [f"pc:b:{r.probe.hex()}" for r in records]
        written += ["pc:keys", "pc:u", f"pc:f:{LOCATION.node}"]
        lookups.append(len({shard_of(name) for name in read}))
        registers.append(len({shard_of(name) for name in written}))
        for name in read:
            per_shard[shard_of(name)] += 1
    shared = {name: shard_of(name) for name in ("pc:keys", "pc:u", f"pc:f:{LOCATION.node}", "pc:ns")}
    return {
        "deployment": f"Redis Cluster, {SHARDS} equal slot ranges (computed)",
        "prompts": SLOT_PROMPTS,
        "keys_per_lookup": PROMPT_CHUNKS,
        "shards_touched_min": min(lookups),
        "shards_touched_mean": sum(lookups) / len(lookups),
        "shards_touched_max": max(lookups),
        "register_shards_touched_mean": sum(registers) / len(registers),
        "keys_per_shard": per_shard,
        "shared_keys_shard": shared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1_000_000, help="chunks indexed for the large-index rows")
    parser.add_argument("--memory-chunks", type=int, default=100_000, help="realistic chunks measured for memory")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of lookups per client count")
    args = parser.parse_args()
    if not SMALL_INDEX <= args.memory_chunks <= args.chunks:
        parser.error(f"need {SMALL_INDEX} <= --memory-chunks <= --chunks")
    ns = spec()
    tokens, query = prompt_query(ns, 1)
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp), admin=True)
        server.start()
        try:
            index = RedisIndex(server.url)
            raw = redis.Redis.from_url(server.admin_url)
            index.register_namespace(ns)
            base = int(raw.info("memory")["used_memory"])
            index.register(full_chunk_records(ns, tokens))
            fill_s = fill(raw, ns, SMALL_INDEX - PROMPT_CHUNKS, seed=2)
            small = latency(index, query, SMALL_INDEX)
            fill_s += fill(raw, ns, args.memory_chunks - SMALL_INDEX, seed=3)
            used = int(raw.info("memory")["used_memory"])
            memory = {
                "deployment": DEPLOYMENT,
                "chunks": args.memory_chunks,
                "bytes_per_chunk": (used - base) / args.memory_chunks,
                "register_chunks_per_s": (args.memory_chunks - PROMPT_CHUNKS) / fill_s,
            }
            large_fill_s = fill(raw, ns, args.chunks - args.memory_chunks, seed=4)
            memory_info = raw.info("memory")
            assert raw.zcard("pc:keys") == args.chunks, raw.zcard("pc:keys")
            large = latency(index, query, args.chunks)
            with RoundTripCounter() as trips:
                index.lookup(query, touch=False)
            runs = [throughput(server.url, raw, 1, n, args.seconds) for n in CLIENTS]
            for run in runs:
                run["round_trips_per_lookup"] = trips.count
            index.close()
        finally:
            server.stop()
    hashing = hashing_ms(tokens)
    slots = slot_spread(ns)
    at_scale = {
        "indexed_chunks": args.chunks,
        "used_memory_bytes": int(memory_info["used_memory"]),
        "used_memory_rss_bytes": int(memory_info["used_memory_rss"]),
        "fill_chunks_per_s": (args.chunks - args.memory_chunks) / large_fill_s if large_fill_s else None,
    }
    print_table(
        f"Redis memory per chunk ({CHUNK_TOKENS}-token chunks, token ids kept, one location each)",
        ["deployment", "chunks", "bytes/chunk", "register chunks/s", f"used_memory at {args.chunks}"],
        [
            [
                DEPLOYMENT,
                memory["chunks"],
                f"{memory['bytes_per_chunk']:.0f}",
                f"{memory['register_chunks_per_s']:.0f}",
                f"{at_scale['used_memory_bytes'] / 2**30:.2f} GiB",
            ]
        ],
    )
    print_table(
        f"Lookup of a cached {PROMPT_CHUNKS}-chunk prompt, hashed beforehand, ms "
        f"(hashing alone: p50 {hashing['p50_ms']:.3f}, p99 {hashing['p99_ms']:.3f})",
        ["deployment", "indexed chunks", "p50", "p99"],
        [[r["deployment"], r["indexed_chunks"], r["p50_ms"], r["p99_ms"]] for r in (small, large)],
    )
    print_table(
        f"Concurrent clients (processes) at {args.chunks} chunks, {args.seconds:g} s each",
        ["deployment", "clients", "lookups/s", "Redis CPU µs/lookup", "Redis CPU share", "commands/lookup", "trips"],
        [
            [
                r["deployment"],
                r["clients"],
                f"{r['lookups_per_s']:.0f}",
                r["redis_cpu_us_per_lookup"],
                r["redis_cpu_share"],
                r["commands_per_lookup"],
                r["round_trips_per_lookup"],
            ]
            for r in runs
        ],
    )
    print_table(
        f"Keys of one lookup ({slots['keys_per_lookup']}) over {SHARDS} equal slot ranges, {SLOT_PROMPTS} prompts",
        ["deployment", "lookup: shards min", "mean", "max", "register: shards", "keys/shard", "shared keys' shards"],
        [
            [
                slots["deployment"],
                slots["shards_touched_min"],
                slots["shards_touched_mean"],
                slots["shards_touched_max"],
                slots["register_shards_touched_mean"],
                " / ".join(map(str, slots["keys_per_shard"])),
                ", ".join(f"{k}: {v}" for k, v in slots["shared_keys_shard"].items()),
            ]
        ],
    )
    payload = {
        "chunk_tokens": CHUNK_TOKENS,
        "prompt_chunks": PROMPT_CHUNKS,
        "cpus": multiprocessing.cpu_count(),
        "memory": [memory],
        "at_scale": at_scale,
        "hashing": hashing,
        "latency": [small, large],
        "throughput": runs,
        "slots": slots,
    }
    path = write_results("index_scale", payload, partial=not with_defaults(parser, args))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
