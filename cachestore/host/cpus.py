"""CPU sets: the kernel's list format ("0-3,8"), and binding the daemon without binding the engines it starts.

On a vLLM CPU host the forward pass owns most cores and vLLM leaves a few to everything else
(``VLLM_CPU_NUM_OF_RESERVED_CPU``). A daemon left unbound can have its write-behind, or the segment
owner's copies into a worker's pages, scheduled onto a compute core, where they slow the forward pass
they serve. ``prefixcache serve --cpus`` binds the daemon and every server it starts to the reserved
cores; the warm-up engines it starts get the cores the daemon had before, since they are vLLM engines.
"""

from __future__ import annotations

import os
from collections.abc import Collection


def cpu_list(text: str) -> frozenset[int]:
    """CPU ids from the kernel's list format, "0-3,8,10-11". Raises ValueError, naming the text, otherwise."""
    cpus: set[int] = set()
    try:
        for part in text.strip().split(","):
            first, dash, last = part.strip().partition("-")
            span = range(int(first), int(last if dash else first) + 1)
            if not span or span.start < 0:
                raise ValueError
            cpus.update(span)
    except ValueError:
        raise ValueError(f"{text!r} is not a CPU list: use ids and ranges, like 1 or 0-3,8") from None
    return frozenset(cpus)


def format_cpu_list(cpus: Collection[int]) -> str:
    """The kernel's list format of ``cpus`` (ranges merged), for messages."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on now."""
    return frozenset(os.sched_getaffinity(0))
