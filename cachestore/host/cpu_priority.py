"""A child process's CPU priority (nice), for its session and its threads: what gives the segment owner a core.

The owner copies every DRAM hit into a vLLM worker's pages while the step waits. On a vLLM CPU host the owner
shares the cores vLLM reserves with vLLM's engine-core process, which busy-polls (``sched_yield``) for its worker's
reply for a second after each one. With autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``, for processes
in the root cgroup) the kernel shares a core between sessions first, and the owner runs in a session of its own, so
it gets only part of the core and a hit's copy takes much longer than alone (docs/decisions.md, "The segment owner
runs at nice -10, threads and autogroup"). A lower nice for the owner's session, and for its threads where
autogroups do not apply, lets it have the core while it copies. Lowering a nice needs CAP_SYS_NICE (or
RLIMIT_NICE); without it the owner keeps the default.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def set_own_nice(nice: int) -> None:
    """In a child before exec: the threads it starts inherit ``nice``. Without the privilege it keeps its own."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def set_process_nice(pid: int, nice: int) -> bool:
    """Give every thread of running process ``pid``, and its session's autogroup, ``nice``; returns whether its
    threads run at ``nice`` now (raising a nice needs no privilege, lowering it CAP_SYS_NICE)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return set_session_nice(pid, nice)


def set_session_nice(pid: int, nice: int) -> bool:
    """Give the autogroup of session leader ``pid`` ``nice`` as well (nothing to do on a kernel without
    autogroups); returns whether ``pid`` runs at ``nice``."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    return os.getpriority(os.PRIO_PROCESS, pid) == nice
