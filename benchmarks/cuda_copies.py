"""How fast the connector moves a hit's pages between a GPU's KV cache and its pinned arena.

A GPU worker loads every hit through arena slots: the chunk's bytes arrive in a pinned slot, then cross
PCIe into the KV cache's blocks (connector/page_copies.py); publishing crosses back. This times both
directions for a 4096-token hit of a Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, bf16, blocks of
16 tokens: 64 KiB pages, 16 chunks of 32 MiB), laid out as vLLM 0.32 lays out FlashAttention's cache
(LBNHC views of one buffer), into consecutive blocks and into blocks scattered over the cache as in a
long-lived engine. Rows:

- ``staged`` (the connector): one PCIe copy per chunk through a device staging buffer, then one kernel
  per layer between the staging buffer and the blocks;
- ``per run``: one copy per run of consecutive blocks and layer, straight across (what a naive connector does);
- ``one copy``: the same bytes in one copy between contiguous pinned and device memory, the ceiling.

Each row's ratio is its time over the ceiling's in the same run. ``queue ms`` is how long the call kept
the calling thread (vLLM's model thread, for a load that is not asynchronous).

Run: ``python -m benchmarks.cuda_copies [--repeats 7]`` on a machine with CUDA. Writes
``benchmarks/results/cuda_copies.json``.
"""

from __future__ import annotations

import argparse
import mmap
import random
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import print_table, with_defaults, write_results
from prefixcache.cachestore.chunks.arena import address_of
from prefixcache.connector.page_copies import CudaPageCopies
from prefixcache.connector.pages import gather, page_rows, scatter

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, CHUNK_TOKENS = 32, 8, 128, 16, 256
PROMPT_TOKENS = 4096
CACHE_BLOCKS = 4096  # 8 GiB of KV: room for a hit's 256 blocks to lie anywhere
CHUNK_PAGES, HIT_PAGES = CHUNK_TOKENS // BLOCK_TOKENS, PROMPT_TOKENS // BLOCK_TOKENS


def vllm_cache() -> list[torch.Tensor]:
    """FlashAttention's cache as vLLM 0.32 hands it over: logical [B, H, N, 2 * head] views, laid out LBNHC."""
    raw = torch.zeros(LAYERS, CACHE_BLOCKS, BLOCK_TOKENS, KV_HEADS, 2 * HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
    return [layer.permute(0, 2, 1, 3) for layer in raw]


def timed(run: Callable[[], None], wait: Callable[[], None], repeats: int) -> tuple[list[float], list[float]]:
    """(seconds until the copies are over, seconds the call kept its thread) per repeat, after a warm-up."""
    run()
    wait()
    total, queued = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        queued.append(time.perf_counter() - started)
        wait()
        total.append(time.perf_counter() - started)
    return total, queued


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed copies per row (the median is reported)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark times copies between a GPU and pinned host memory")
    pages = [page_rows(layer) for layer in vllm_cache()]
    page_bytes = pages[0].shape[1]
    hit_bytes = LAYERS * HIT_PAGES * page_bytes
    arena = mmap.mmap(-1, hit_bytes)
    host = memoryview(arena)
    copies = CudaPageCopies(pages, (address_of(host), len(host)), CHUNK_PAGES)
    payload = torch.frombuffer(host, dtype=torch.uint8).view(HIT_PAGES // CHUNK_PAGES, LAYERS, CHUNK_PAGES, page_bytes)
    payload.random_(0, 256)
    stream = torch.cuda.Stream()
    device_copy = torch.empty(hit_bytes, dtype=torch.uint8, device="cuda")
    flat_host = torch.frombuffer(host, dtype=torch.uint8)
    layouts = {
        "consecutive": list(range(100, 100 + HIT_PAGES)),
        "scattered": random.Random(0).sample(range(CACHE_BLOCKS), HIT_PAGES),
    }
    times: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    try:
        times[("load", "one copy", "-")] = timed(
            lambda: device_copy.copy_(flat_host, non_blocking=True), torch.cuda.synchronize, args.repeats
        )
        times[("publish", "one copy", "-")] = timed(
            lambda: flat_host.copy_(device_copy, non_blocking=True), torch.cuda.synchronize, args.repeats
        )
        for name, blocks in layouts.items():
            chunks = [blocks[i : i + CHUNK_PAGES] for i in range(0, HIT_PAGES, CHUNK_PAGES)]

            def staged_load(chunks=chunks) -> None:
                for src, part in zip(payload, chunks, strict=True):
                    copies.scatter(src, part)

            def staged_publish(chunks=chunks) -> None:
                for out, part in zip(payload, chunks, strict=True):
                    copies.gather(part, out)

            def per_run_load(chunks=chunks) -> None:
                with torch.cuda.stream(stream):
                    for src, part in zip(payload, chunks, strict=True):
                        scatter(src, pages, part, non_blocking=True)

            def per_run_publish(chunks=chunks) -> None:
                with torch.cuda.stream(stream):
                    for out, part in zip(payload, chunks, strict=True):
                        gather(pages, part, out, non_blocking=True)

            times[("load", "staged", name)] = timed(staged_load, copies.loaded, args.repeats)
            times[("publish", "staged", name)] = timed(staged_publish, lambda: copies.saved()(), args.repeats)
            times[("load", "per run", name)] = timed(per_run_load, stream.synchronize, args.repeats)
            times[("publish", "per run", name)] = timed(per_run_publish, stream.synchronize, args.repeats)
        check = pages[5][layouts["scattered"][:CHUNK_PAGES]].cpu()  # the last publish read these back
        if not torch.equal(check, payload[0, 5]):
            raise RuntimeError("the pages published are not the pages loaded")
    finally:
        copies.close()
    rows, cases = [], []
    for (direction, row, blocks), (total, queued) in times.items():
        ceiling = statistics.median(times[(direction, "one copy", "-")][0])
        median = statistics.median(total)
        rows.append(
            (
                direction,
                row,
                blocks,
                median * 1000,
                statistics.median(queued) * 1000,
                hit_bytes / median / 1e9,
                median / ceiling,
            )
        )
        cases.append(
            {
                "direction": direction,
                "copies": row,
                "blocks": blocks,
                "total_s": total,
                "queued_s": queued,
                "median_s": median,
                "gbps": hit_bytes / median / 1e9,
                "over_one_copy": median / ceiling,
            }
        )
    device = torch.cuda.get_device_name()
    print_table(
        f"a {PROMPT_TOKENS}-token hit ({hit_bytes >> 20} MiB, {page_bytes >> 10} KiB pages) on {device}, "
        f"medians of {args.repeats}",
        ["direction", "copies", "blocks", "ms", "queue ms", "GB/s", "/ one copy"],
        rows,
    )
    write_results(
        "cuda_copies",
        {
            "device": device,
            "hit_bytes": hit_bytes,
            "page_bytes": page_bytes,
            "layers": LAYERS,
            "chunk_pages": CHUNK_PAGES,
            "cases": cases,
        },
        partial=not with_defaults(parser, args),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
