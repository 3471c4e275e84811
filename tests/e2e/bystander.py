"""A process that does, each time it is told, the work a DRAM hit does beside vLLM's forward pass, and nothing
else: copy some bytes from one buffer into another, then compute a chunk MAC (keyed BLAKE3) over the bytes copied
into. tests/e2e/run_vllm.py starts it for ``spec.bystander``, so that benchmarks/hit_budget.py can measure what
moving and verifying a hit's KV costs vLLM's own hit on the cores where that work would run, with no connector in
the engine at all.

    python -m tests.e2e.bystander COPY_BYTES MAC_BYTES CPUS

It binds itself to ``CPUS`` (the kernel's list format), does the work once to touch its buffers, prints ``ready``,
then, for each line read from stdin, does the work once and prints the seconds it took. It exits at the end of
stdin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from prefixcache.cachestore.chunks.mac import KEY_BYTES, ChunkMacKey
from prefixcache.cachestore.host.cpus import cpu_list, format_cpu_list


class Bystander:
    """The process, from the side that tells it when to work (``start``, then ``wait`` for how long it took)."""

    def __init__(self, copy_bytes: int, mac_bytes: int, cpus: list[int]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.bystander", str(copy_bytes), str(mac_bytes), format_cpu_list(cpus)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        if (line := self._stdout.readline().strip()) != "ready":
            self.close()
            raise RuntimeError(f"the bystander did not start (it said {line!r})")

    def start(self) -> None:
        """Have it do its work once, now; this returns at once."""
        self._stdin.write("go\n")
        self._stdin.flush()

    def wait(self) -> float:
        """The seconds the work ``start`` began took, once it is over."""
        return float(self._stdout.readline())

    def close(self) -> None:
        """End its stdin and wait for it to exit."""
        self._stdin.close()
        self._process.wait(timeout=30)

    @property
    def returncode(self) -> int | None:
        """Its exit status, once it has exited."""
        return self._process.returncode


def main(argv: list[str]) -> int:
    copy_bytes, mac_bytes, cpus = int(argv[0]), int(argv[1]), cpu_list(argv[2])
    if not 0 < copy_bytes <= mac_bytes:
        print("COPY_BYTES must be positive and at most MAC_BYTES", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, cpus)
    source = np.ones(copy_bytes, np.uint8)
    pages = np.zeros(mac_bytes, np.uint8)  # the copy's target, and what the MAC covers
    key = ChunkMacKey(os.urandom(KEY_BYTES))
    work(source, pages, key)  # once unmeasured: the first round touches fresh pages
    print("ready", flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        work(source, pages, key)
        print(time.perf_counter() - started, flush=True)
    return 0


def work(source: np.ndarray, pages: np.ndarray, key: ChunkMacKey) -> None:
    """Copy ``source`` into the start of ``pages``, then MAC all of ``pages``."""
    np.copyto(pages[: source.nbytes], source)
    key.hasher().update(pages).digest()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
