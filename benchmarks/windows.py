"""What a load larger than the connector's arena costs: the same hit through slots, whole and in windows.

A KV cache outside shared memory (every GPU, and a CPU worker with ``kv_in_shared_memory: false``) loads
through arena slots. A hit larger than the arena's free room loads in windows of as many chunks as have slots
(the connector's loader through arena slots, docs/connector.md). This runs one worker side against the real
daemon (``prefixcache serve``: redis-server, mooncake_master, a segment owner, RocksDB files) and loads a 256
MiB hit of 2 MiB chunks (8 layers of two 128 KiB pages, the tiny test Llama's chunk) into a KV cache of CPU
tensors (``--device cuda``: on a GPU), from DRAM and, with the DRAM copies deleted before each load, from
NVMe, with arenas of 512 MiB (one window), 64 MiB and 32 MiB. Rows alternate within each round, each going
first in turn, so every row sees the same machine; figures are medians, and ratios are per-round ratios to the
one-window load of the same tier.

Run: ``python -m benchmarks.windows [--rounds 5] [--device cuda]``. Writes ``benchmarks/results/windows.json``
(``windows_cuda.json`` for a cache on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_table, with_defaults, write_results
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from prefixcache.connector.worker_side import WorkerSide
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import Daemon, make_spec, wait_persisted

LAYERS, PAGE_BYTES, BLOCK_TOKENS, CHUNK_TOKENS = 8, 128 << 10, 128, 256
PAGES = CHUNK_TOKENS // BLOCK_TOKENS
CHUNKS = 128  # 256 MiB
ARENAS_MIB = (512, 64, 32)


def kv_cache(device: str) -> list[torch.Tensor]:
    return list(torch.zeros(LAYERS, CHUNKS * PAGES, PAGE_BYTES, dtype=torch.uint8, device=device))


def worker(daemon: Daemon, arena_mib: int, device: str) -> WorkerSide:
    client = CacheClient.connect(daemon.url, make_spec(CHUNK_TOKENS), arena_bytes=arena_mib << 20)
    return WorkerSide(client, kv_cache(device), BLOCK_TOKENS)


def publish(publisher: WorkerSide) -> list[LoadChunk]:
    """Publish CHUNKS chunks of random pages; returns the plan that loads all of them into blocks 0.."""
    for layer in publisher.layers:
        layer.random_(0, 256)
    parent, saves, plan = publisher.client.spec.root(), [], []
    for i in range(CHUNKS):
        tokens = pack_tokens(range(i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS))
        blocks = list(range(i * PAGES, (i + 1) * PAGES))
        saves.append(SaveChunk("bench", [parent], tokens, blocks, None))
        parent = chunk_key(parent, tokens)
        plan.append(LoadChunk(parent, CHUNK_TOKENS, 0, blocks))
    for start in range(0, CHUNKS, 16):  # a step's worth at a time, so the publisher's arena holds them
        publisher.save(PrefixCacheMetadata(saves=saves[start : start + 16]))
        wait_until(lambda start=start: publisher.published_chunks >= min(start + 16, CHUNKS), "publishes")
    return plan


def wait_until(condition, what: str, timeout_s: float = 120) -> None:  # noqa: ANN001 - a zero-argument predicate
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish in {timeout_s} s")
        time.sleep(0.01)


def timed_load(loader: WorkerSide, plan: list[LoadChunk], in_dram: bool) -> float:
    chunks = [LoadChunk(c.key, c.stored_tokens, c.first_page, c.blocks, in_dram=in_dram) for c in plan]
    started = time.perf_counter()
    loader.start_load(PrefixCacheMetadata(loads=[{"bench": chunks}]))
    errors = loader.take_load_errors()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} blocks failed to load")
    loader.save(PrefixCacheMetadata())  # as after a forward pass: NVMe reads go back to DRAM now
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="loads per row (the median is reported)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the KV cache lies (cuda: pages cross PCIe from pinned slots)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    hit_bytes = CHUNKS * LAYERS * PAGES * PAGE_BYTES
    with tempfile.TemporaryDirectory(prefix="prefixcache-windows-") as tmp:
        daemon = Daemon(Path(tmp) / "data", dram="1GiB", nvme="1GiB").start()
        publisher = loaders = None
        try:
            publisher = worker(daemon, 64, args.device)
            plan = publish(publisher)
            keys = [chunk.key for chunk in plan]
            wait_persisted(publisher.client, keys, timeout_s=120)
            loaders = {arena: worker(daemon, arena, args.device) for arena in ARENAS_MIB}
            times: dict[tuple[str, int], list[float]] = {}
            for tier in ("dram", "nvme"):
                for round_ in range(args.rounds):
                    shift = round_ % len(ARENAS_MIB)  # each row goes first in turn
                    for arena in ARENAS_MIB[shift:] + ARENAS_MIB[:shift]:
                        loader = loaders[arena]
                        if tier == "nvme":
                            publisher.client.dram.delete(keys)
                        times.setdefault((tier, arena), []).append(timed_load(loader, plan, in_dram=tier == "dram"))
                        # chunks read from NVMe go back into DRAM in the background; let that end first
                        arena_of = loader.client.dram.arena
                        wait_until(lambda arena_of=arena_of: arena_of.free_bytes == arena_of.size, "stores into DRAM")
        finally:
            for w in [publisher, *(loaders or {}).values()]:
                if w is not None:
                    w.close()
            daemon.stop()
    rows, cases = [], []
    for (tier, arena), samples in times.items():
        whole = times[(tier, ARENAS_MIB[0])]
        ratio = statistics.median(s / w for s, w in zip(samples, whole, strict=True))
        median = statistics.median(samples)
        windows = -(-hit_bytes // (arena << 20))
        rows.append((tier, f"{arena} MiB", windows, median * 1000, hit_bytes / median / 1e9, ratio))
        cases.append(
            {
                "tier": tier,
                "arena_mib": arena,
                "windows": windows,
                "load_s": samples,
                "median_s": median,
                "gbps": hit_bytes / median / 1e9,
                "over_one_window": ratio,
            }
        )
    print_table(
        f"a {hit_bytes >> 20} MiB hit through arena slots into a {args.device} cache, medians of {args.rounds}",
        ["tier", "arena", "windows (about)", "load ms", "GB/s", "/ one window"],
        rows,
    )
    name = "windows" if args.device == "cpu" else f"windows_{args.device}"
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    partial = not with_defaults(parser, args, apart_from=["device"])  # each device has a file of its own
    write_results(name, {"hit_bytes": hit_bytes, "device": device, "cases": cases}, partial=partial)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
