"""What sealing a chunk for the object tier costs beside signing it: AES-256-GCM seal and open against the keyed
BLAKE3 MAC every chunk carries (cachestore/chunks/seal.py, cachestore/chunks/mac.py), one core, chunk-sized
buffers, medians of ``--repeats`` runs. The figures are docs/decisions.md's ("Objects leave the machine sealed").

Run: ``python -m benchmarks.seal [--repeats 21]``. Prints its table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from benchmarks.common import print_table
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.chunks.seal import ChunkSealer

SIZES_MIB = (2, 8)


def gbps(size: int, call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return size / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    key = ChunkMacKey(os.urandom(32))
    sealer = ChunkSealer(key)
    rows = []
    for mib in SIZES_MIB:
        data = os.urandom(mib << 20)
        sealed = sealer.seal("name", data)
        mac = gbps(len(data), lambda data=data: key.hasher().update(data).digest(), args.repeats)
        seal = gbps(len(data), lambda data=data: sealer.seal("name", data), args.repeats)
        unseal = gbps(len(data), lambda sealed=sealed: sealer.open("name", sealed), args.repeats)
        rows.append((mib, mac, seal, unseal, mac / seal, mac / unseal))
    print_table(
        "sealing beside the MAC, GB/s on one core",
        ["MiB", "BLAKE3 MAC", "AES-GCM seal", "AES-GCM open", "seal / MAC time", "open / MAC time"],
        rows,
    )


if __name__ == "__main__":
    main()
