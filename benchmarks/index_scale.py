"""What the index costs one Redis and a 3-master Redis Cluster, measured side by side in one run.

Each deployment runs on redis-servers of its own on free ports, persisting as deployed (AOF, ``appendfsync
everysec``): "single Redis" is the daemon's embedded server, "3-shard cluster" three cluster masters without
replicas (``tests/redis_topologies.py``), whose index puts every key of a chain under the chain's first chunk
as hash tag (``indexer/redis_shards.py``). For each it measures:

1. The key distribution of 64 system prompts of 16 chunks with different first chunks, registered one by one
   through ``RedisIndex.register`` on an empty index: how many chains each master holds (the master whose
   ``CLUSTER COUNTKEYSINSLOT`` counts keys in the slot of the chain's anchor) and its keys (``DBSIZE``), how many
   masters one register and one lookup of each prompt touch (masters whose ``INFO commandstats`` moved) and the
   round trips of each lookup, counted client-side.
2. Redis memory per stored chunk: the sum over masters of ``INFO memory`` used_memory before and after
   registering ``--memory-chunks`` chunks of 256 tokens (token ids kept in the probe bucket as the index stores
   them, one DRAM location each, so one change-feed entry each), divided by their number.
3. Longest-prefix lookup latency, p50/p99, of the cached prompts in turn once the index holds 10k, then
   ``--chunks`` chunks. Queries are hashed beforehand (hashing is timed on its own) and lookups skip the
   access-time update, which the client batches in the background. Every chunk is registered by
   ``RedisIndex.register``, which sends each record to the master of its chain's anchor, in calls of thousands
   of records: chains of 64 chunks of token ids drawn with numpy.
4. Lookups per second from N concurrent clients (processes, one connection per master each, every client
   going through the cached prompts from an offset of its own), with the ratio of the cluster's to the single
   Redis's at each N, and what predicts a larger cluster's throughput: each master's Redis CPU time per lookup
   (``INFO cpu`` user+sys delta over the lookups, divided by all lookups), commands the masters ran per lookup
   (``INFO commandstats``) and round trips per lookup, counted client-side (one, on both).

On a machine with few cores the clients and every master share them: lookups per second then say more about
the machine than about Redis, and the CPU per lookup less so.
Run: ``python -m benchmarks.index_scale`` (``--chunks``, ``--memory-chunks``, ``--seconds`` shrink it; any
flag off its default writes ``index_scale.partial.json``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
from redis.crc import key_slot

from benchmarks.common import percentile_ms, print_table, with_defaults, write_results
from benchmarks.lookup import CHUNK_TOKENS, RoundTripCounter, chain_records
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import ChunkRecord
from prefixcache.indexer.keys import PrefixHasher, PrefixQuery
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex
from tests.redis_topologies import RedisClusterServers

PROMPT_CHUNKS = 16  # a cached system prompt: 4096 tokens
SYSTEM_PROMPTS = 64  # cached prompts with different first chunks
PROMPT_SEED = 10_000  # system prompt i is drawn with seed PROMPT_SEED + i
FILL_CHAIN = 64  # chunks per synthetic chain
BATCH = 2000  # records per register call
#: The index's socket timeout here: a register call of ``BATCH`` records takes far longer than a production one.
FILL_SOCKET_TIMEOUT_S = 60.0
SMALL_INDEX = 10_000
LATENCY_LOOKUPS = 5000
CLIENTS = (1, 2, 4, 8)
SHARDS = 3
SINGLE, CLUSTER = "single Redis", f"{SHARDS}-shard cluster"


@dataclass(frozen=True)
class Deployment:
    """Where an index runs: the URL it is given, and a connection to each master allowed ``INFO``."""

    name: str
    url: str
    masters: list[redis.Redis]


@contextmanager
def single_redis(tmp: Path) -> Iterator[Deployment]:
    server = EmbeddedRedis(tmp, admin=True)
    server.start()
    try:
        yield Deployment(SINGLE, server.url, [redis.Redis.from_url(server.admin_url)])
    finally:
        server.stop()


@contextmanager
def redis_cluster(tmp: Path) -> Iterator[Deployment]:
    servers = RedisClusterServers(tmp, masters=SHARDS, replicas=0)
    try:
        yield Deployment(CLUSTER, servers.url, [node.client() for node in servers.masters()])
    finally:
        servers.stop()


def spec() -> NamespaceSpec:
    return NamespaceSpec(
        model="bench", model_fingerprint="b", kv_dtype="bfloat16", kv_layout="chunk-v1", chunk_tokens=CHUNK_TOKENS
    )


def full_chunk_records(ns: NamespaceSpec, tokens: np.ndarray) -> list[ChunkRecord]:
    """The records of a prompt of whole chunks (``tokens``: a multiple of ``CHUNK_TOKENS``)."""
    return chain_records(ns, tokens.astype("<u4").tobytes())


def synthetic_records(ns: NamespaceSpec, count: int, seed: int) -> Iterator[list[ChunkRecord]]:
    """``count`` chunks of random prompts, ``FILL_CHAIN`` chunks a prompt, in batches of whole prompts of about
    ``BATCH`` records."""
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


def fill(index: RedisIndex, ns: NamespaceSpec, count: int, seed: int) -> float:
    """Register ``count`` synthetic chunks, ``BATCH`` records a call; returns the seconds taken."""
    started = time.perf_counter()
    for records in synthetic_records(ns, count, seed):
        index.register(records)
    return time.perf_counter() - started


def cpu_s(master: redis.Redis) -> float:
    info = master.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def commands(master: redis.Redis) -> int:
    """Commands the master has run, those inside scripts included, less INFO (this benchmark's own)."""
    stats = master.info("commandstats")
    return sum(int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info")


def used_memory(masters: Sequence[redis.Redis]) -> int:
    return sum(int(master.info("memory")["used_memory"]) for master in masters)


def prompt_tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, PROMPT_CHUNKS * CHUNK_TOKENS, dtype=np.uint32)


def prompt_queries(ns: NamespaceSpec) -> list[PrefixQuery]:
    geometry = ChunkGeometry(CHUNK_TOKENS)
    seeds = range(PROMPT_SEED, PROMPT_SEED + SYSTEM_PROMPTS)
    return [PrefixHasher(ns.root(), geometry).extend(prompt_tokens(seed)).query() for seed in seeds]


def masters_touched(masters: Sequence[redis.Redis], call: Callable[[], object]) -> int:
    """How many masters ran a command during ``call``."""
    before = [commands(master) for master in masters]
    call()
    return sum(commands(master) > ran for master, ran in zip(masters, before, strict=True))


def round_trips(index: RedisIndex, query: PrefixQuery) -> int:
    with RoundTripCounter() as trips:
        match = index.lookup(query, touch=False)
    assert len(match.keys) == PROMPT_CHUNKS, len(match.keys)
    return trips.count


def key_distribution(index: RedisIndex, deployment: Deployment, ns: NamespaceSpec) -> dict:
    """Register the system prompts one by one on an empty index, then where their keys went and what one
    register and one lookup of each touched."""
    registers = [
        masters_touched(
            deployment.masters, lambda seed=seed: index.register(full_chunk_records(ns, prompt_tokens(seed)))
        )
        for seed in range(PROMPT_SEED, PROMPT_SEED + SYSTEM_PROMPTS)
    ]
    queries = prompt_queries(ns)
    lookups = [masters_touched(deployment.masters, lambda q=q: index.lookup(q, touch=False)) for q in queries]
    trips = [round_trips(index, query) for query in queries]
    masters = []
    for master in deployment.masters:
        chains = len(queries)  # one Redis holds every chain
        if index.clustered:  # a chain's keys share the slot of its anchor, which one master serves
            anchors = [key_slot(q.keys[0].hex().encode()) for q in queries]
            chains = sum(int(master.cluster("COUNTKEYSINSLOT", slot)) > 0 for slot in anchors)
        masters.append({"chains": chains, "keys": int(master.dbsize())})
    return {
        "deployment": deployment.name,
        "prompts": SYSTEM_PROMPTS,
        "masters": masters,
        "register_masters_touched_mean": sum(registers) / len(registers),
        "lookup_masters_touched_min": min(lookups),
        "lookup_masters_touched_max": max(lookups),
        "round_trips_per_lookup_max": max(trips),
    }


def latency(index: RedisIndex, deployment: Deployment, queries: Sequence[PrefixQuery], indexed: int) -> dict:
    for i in range(1000):  # warm-up
        index.lookup(queries[i % len(queries)], touch=False)
    samples = []
    for i in range(LATENCY_LOOKUPS):
        start = time.perf_counter()
        match = index.lookup(queries[i % len(queries)], touch=False)
        samples.append(time.perf_counter() - start)
        assert len(match.keys) == PROMPT_CHUNKS, len(match.keys)
    return {
        "deployment": deployment.name,
        "indexed_chunks": indexed,
        "p50_ms": percentile_ms(samples, 50),
        "p99_ms": percentile_ms(samples, 99),
    }


def hashing_ms() -> dict:
    geometry, root, tokens, samples = ChunkGeometry(CHUNK_TOKENS), spec().root(), prompt_tokens(PROMPT_SEED), []
    for _ in range(LATENCY_LOOKUPS):
        start = time.perf_counter()
        PrefixHasher(root, geometry).extend(tokens).query()
        samples.append(time.perf_counter() - start)
    return {"p50_ms": percentile_ms(samples, 50), "p99_ms": percentile_ms(samples, 99)}


def client(url: str, offset: int, seconds: float, ready, start, counts) -> None:
    """One concurrent client: its own connections, the cached prompts in turn from ``offset``, lookups for
    ``seconds``."""
    index = RedisIndex(url)
    queries = prompt_queries(spec())
    for query in queries:  # every master's connection open, every script loaded
        index.lookup(query, touch=False)
    ready.put(offset)
    start.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        index.lookup(queries[(offset + done) % len(queries)], touch=False)
        done += 1
    counts.put(done)
    index.close()


def throughput(deployment: Deployment, clients: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ready, start, counts = ctx.Queue(), ctx.Event(), ctx.Queue()
    offsets = [i * SYSTEM_PROMPTS // clients for i in range(clients)]
    workers = [ctx.Process(target=client, args=(deployment.url, o, seconds, ready, start, counts)) for o in offsets]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=120)
    masters = deployment.masters
    cpu_before, commands_before = [cpu_s(m) for m in masters], sum(commands(m) for m in masters)
    started = time.perf_counter()
    start.set()
    lookups = sum(counts.get(timeout=seconds + 60) for _ in workers)
    wall = time.perf_counter() - started
    cpu = [cpu_s(m) - before for m, before in zip(masters, cpu_before, strict=True)]
    ran = sum(commands(m) for m in masters) - commands_before
    for worker in workers:
        worker.join()
    return {
        "deployment": deployment.name,
        "clients": clients,
        "lookups": lookups,
        "lookups_per_s": lookups / wall,
        "redis_cpu_us_per_lookup": sum(cpu) / lookups * 1e6,
        "shard_cpu_us_per_lookup": [s / lookups * 1e6 for s in cpu],
        "redis_cpu_share": sum(cpu) / wall,  # of one core
        "commands_per_lookup": ran / lookups,
    }


def measure(deployment: Deployment, ns: NamespaceSpec, args: argparse.Namespace) -> dict:
    """Every row of one deployment (see the module's docstring)."""
    index = RedisIndex(deployment.url, socket_timeout_s=FILL_SOCKET_TIMEOUT_S)
    try:
        index.register_namespace(ns)
        base = used_memory(deployment.masters)
        shards = key_distribution(index, deployment, ns)
        queries = prompt_queries(ns)
        cached = SYSTEM_PROMPTS * PROMPT_CHUNKS
        fill_s = fill(index, ns, SMALL_INDEX - cached, seed=2)
        small = latency(index, deployment, queries, SMALL_INDEX)
        fill_s += fill(index, ns, args.memory_chunks - SMALL_INDEX, seed=3)
        grown = used_memory(deployment.masters) - base
        large_fill_s = fill(index, ns, args.chunks - args.memory_chunks, seed=4)
        indexed = index.usage()[ns.digest].entries.chunks
        assert indexed == args.chunks, indexed
        memory = {
            "deployment": deployment.name,
            "chunks": args.memory_chunks,
            "bytes_per_chunk": grown / args.memory_chunks,
            "register_chunks_per_s": (args.memory_chunks - cached) / fill_s,
            "indexed_chunks": args.chunks,
            "used_memory_bytes": used_memory(deployment.masters),
            "used_memory_rss_bytes": sum(int(m.info("memory")["used_memory_rss"]) for m in deployment.masters),
            "fill_chunks_per_s": (args.chunks - args.memory_chunks) / large_fill_s if large_fill_s else None,
        }
        large = latency(index, deployment, queries, args.chunks)
        trips = max(round_trips(index, query) for query in queries)
        assert trips == 1, trips
        runs = [throughput(deployment, n, args.seconds) for n in CLIENTS]
        for run in runs:
            run["round_trips_per_lookup"] = trips
    finally:
        index.close()
    return {"memory": memory, "latency": [small, large], "throughput": runs, "shards": shards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1_000_000, help="chunks indexed for the large-index rows")
    parser.add_argument("--memory-chunks", type=int, default=100_000, help="realistic chunks measured for memory")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of lookups per client count")
    args = parser.parse_args()
    if not SMALL_INDEX <= args.memory_chunks <= args.chunks:
        parser.error(f"need {SMALL_INDEX} <= --memory-chunks <= --chunks")
    ns = spec()
    measured = []
    for name, deployment_in in (("single", single_redis), ("cluster", redis_cluster)):
        with tempfile.TemporaryDirectory() as tmp, deployment_in(Path(tmp) / name) as deployment:
            measured.append(measure(deployment, ns, args))
    hashing = hashing_ms()
    memory = [m["memory"] for m in measured]
    latencies = [row for m in measured for row in m["latency"]]
    runs = [row for m in measured for row in m["throughput"]]
    shards = [m["shards"] for m in measured]
    single_runs, cluster_runs = ({r["clients"]: r for r in m["throughput"]} for m in measured)
    ratios = [
        {"clients": n, "cluster_over_single": cluster_runs[n]["lookups_per_s"] / single_runs[n]["lookups_per_s"]}
        for n in CLIENTS
    ]
    print_table(
        f"Redis memory per chunk ({CHUNK_TOKENS}-token chunks, token ids kept, one location each), all masters",
        ["deployment", "chunks", "bytes/chunk", "register chunks/s", "indexed chunks", "used_memory"],
        [
            [
                m["deployment"],
                m["chunks"],
                f"{m['bytes_per_chunk']:.0f}",
                f"{m['register_chunks_per_s']:.0f}",
                m["indexed_chunks"],
                f"{m['used_memory_bytes'] / 2**30:.2f} GiB",
            ]
            for m in memory
        ],
    )
    print_table(
        f"Lookup of a cached {PROMPT_CHUNKS}-chunk prompt, hashed beforehand, ms "
        f"(hashing alone: p50 {hashing['p50_ms']:.3f}, p99 {hashing['p99_ms']:.3f})",
        ["deployment", "indexed chunks", "p50", "p99"],
        [[r["deployment"], r["indexed_chunks"], r["p50_ms"], r["p99_ms"]] for r in latencies],
    )
    ratio_of = {r["clients"]: r["cluster_over_single"] for r in ratios}
    print_table(
        f"Concurrent clients (processes) at {args.chunks} chunks, {args.seconds:g} s each",
        [
            "deployment",
            "clients",
            "lookups/s",
            "cluster / single",
            "Redis CPU µs/lookup per shard",
            "Redis CPU share",
            "commands/lookup",
            "trips",
        ],
        [
            [
                r["deployment"],
                r["clients"],
                f"{r['lookups_per_s']:.0f}",
                f"{ratio_of[r['clients']]:.2f}" if r["deployment"] == CLUSTER else "",
                " / ".join(f"{s:.1f}" for s in r["shard_cpu_us_per_lookup"]),
                r["redis_cpu_share"],
                r["commands_per_lookup"],
                r["round_trips_per_lookup"],
            ]
            for r in runs
        ],
    )
    print_table(
        f"{SYSTEM_PROMPTS} system prompts of {PROMPT_CHUNKS} chunks with different first chunks, on an empty index",
        ["deployment", "chains per master", "keys per master", "masters a register touches", "a lookup", "trips"],
        [
            [
                s["deployment"],
                " / ".join(str(m["chains"]) for m in s["masters"]),
                " / ".join(str(m["keys"]) for m in s["masters"]),
                s["register_masters_touched_mean"],
                f"{s['lookup_masters_touched_min']}-{s['lookup_masters_touched_max']}",
                s["round_trips_per_lookup_max"],
            ]
            for s in shards
        ],
    )
    payload = {
        "chunk_tokens": CHUNK_TOKENS,
        "prompt_chunks": PROMPT_CHUNKS,
        "cpus": multiprocessing.cpu_count(),
        "memory": memory,
        "hashing": hashing,
        "latency": latencies,
        "throughput": runs,
        "throughput_ratios": ratios,
        "shards": shards,
    }
    path = write_results("index_scale", payload, partial=not with_defaults(parser, args))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
