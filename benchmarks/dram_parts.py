"""Reading chunks' DRAM copies, each two objects: in one Mooncake call where the reader knows the cut, in two
where it learns it from the first part's header.

A chunk's DRAM copy is its first layers, then the rest (cachestore/tiers/dram.py). A load through arena slots (every
GPU hit; on a CPU, a cache outside shared memory) reads a group at a time, one ``get_into`` per group: about
8 MiB into a CPU's cache, 32 MiB into a GPU's (connector/page_copies.py). The connector knows its chunks'
geometry and passes each cut (``split_at``), so a group is one call; a reader that does not (the daemon's
write-behind) reads the first parts, then the second parts where their headers say the first ended: a call
more. This attaches to a segment owner of its own (a 1 GiB segment, warmed as the daemon warms it), puts
chunks of 8 layers, and reads one group into arena slots both ways and copies as many bytes with numpy (the
anchor), in rounds that run the three in turn, each going first in turn. Figures are medians; ratios, medians
of per-round ratios.

Run: ``python -m benchmarks.dram_parts [--rounds 41]``. Writes ``benchmarks/results/dram_parts.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import print_table, with_defaults, write_results
from benchmarks.tiers import ROOT, warmed_tier
from prefixcache.cachestore.chunks.codec import ChunkMeta, encode, read_meta
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.tiers.dram import MooncakeTier, split_offset
from prefixcache.indexer.tokens import pack_tokens

LAYERS = 8
#: (group, chunk) sizes in MiB: a CPU's group of the tiny test Llama's 2 MiB chunks, a GPU's, and a GPU's group
#: of 8 MiB chunks (an 8B model's 64-token chunk, 128 KiB of KV per token)
CASES = ((8, 2), (32, 2), (32, 8))
WAYS = ("cut known", "cut from headers", "memcpy")
SLOT_SLACK = 4096  # bytes a slot has past its object, as a load's slots do (rounded up for O_DIRECT reads)


def chunks(
    tier: MooncakeTier, group_mib: int, chunk_mib: int
) -> tuple[list[bytes], list[int | None], list[memoryview]]:
    """Put a group's chunks; their keys, their cuts and a slot for each (``SLOT_SLACK`` larger than the chunk)."""
    objects = []
    for _ in range(group_mib // chunk_mib):
        meta = ChunkMeta(
            os.urandom(16),
            os.urandom(16),
            os.urandom(16),
            pack_tokens(list(range(256))),
            "uint8",
            (LAYERS, (chunk_mib << 20) // LAYERS),
        )
        objects.append((meta.key, bytes(encode(meta, os.urandom(chunk_mib << 20), ChunkMacKey(os.urandom(32))))))
    assert all(tier.put(objects)), "DRAM put failed"
    cuts = [split_offset(read_meta(obj)) for _, obj in objects]
    assert all(cut is not None for cut in cuts)
    return [key for key, _ in objects], cuts, [tier.arena.alloc(len(obj) + SLOT_SLACK) for _, obj in objects]


def measure(tier: MooncakeTier, group_mib: int, chunk_mib: int, rounds: int) -> dict:
    keys, cuts, slots = chunks(tier, group_mib, chunk_mib)
    sizes = [len(slot) - SLOT_SLACK for slot in slots]
    src, dst = np.ones(group_mib << 20, dtype=np.uint8), np.zeros(group_mib << 20, dtype=np.uint8)
    step = chunk_mib << 20

    def memcpy() -> None:
        for start in range(0, len(src), step):
            np.copyto(dst[start : start + step], src[start : start + step])

    runs: dict[str, Callable[[], object]] = {
        "cut known": lambda: tier.get_into(keys, slots, cuts),
        "cut from headers": lambda: tier.get_into(keys, slots),
        "memcpy": memcpy,
    }
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in WAYS[r % 3 :] + WAYS[: r % 3]:
            start = time.perf_counter()
            got = runs[way]()
            times[way].append(time.perf_counter() - start)
            assert way == "memcpy" or got == sizes, f"{way}: DRAM get missed"
    tier.delete(keys)
    for slot in slots:
        tier.arena.free(slot)
    median = {way: statistics.median(samples) for way, samples in times.items()}
    ratio = statistics.median(k / h for k, h in zip(times["cut known"], times["cut from headers"], strict=True))
    return {
        "group_mib": group_mib,
        "chunk_mib": chunk_mib,
        **{f"{way} ms": median[way] * 1000 for way in WAYS},
        "known / headers": ratio,
        "known / memcpy": median["cut known"] / median["memcpy"],
        "samples_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=41, help="reads per way and case (the median is reported)")
    args = parser.parse_args(argv)
    if not 3 <= args.rounds <= 10_000:
        parser.error("--rounds must be 3-10000")
    ROOT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dram-parts-", dir=ROOT))
    try:
        with warmed_tier(work, arena_bytes=128 << 20) as tier:
            cases = [measure(tier, group, chunk, args.rounds) for group, chunk in CASES]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    columns = ["group_mib", "chunk_mib", *(f"{way} ms" for way in WAYS), "known / headers", "known / memcpy"]
    print_table(
        f"one group's get_into from DRAM, medians of {args.rounds}",
        columns,
        [[case[c] for c in columns] for case in cases],
    )
    path = write_results("dram_parts", {"rounds": args.rounds, "cases": cases}, partial=not with_defaults(parser, args))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
