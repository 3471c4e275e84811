"""Trace points of a hit's path through the connector, for benchmarks/hit_budget.py: off unless the environment
variable ``PREFIXCACHE_TRACE_DIR`` names a directory when the connector is imported.

Each process that records writes ``trace-<pid>.jsonl`` there, a line per point: ``{"t": time.monotonic(), "event":
name, "req": request id or null, "thread": the thread's name, ...}``. ``time.monotonic`` is one clock for every
process of a host, the clock of vLLM's own engine-core timestamps (``RequestStateStats``), so a benchmark lines the
points of the scheduler's and the workers' processes up with vLLM's own. Off, a point costs a call and one test of
a module-level flag.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

TRACE_DIR_ENV = "PREFIXCACHE_TRACE_DIR"
_DIR = Path(os.environ[TRACE_DIR_ENV]) if os.environ.get(TRACE_DIR_ENV) else None
ON = _DIR is not None
_lock = threading.Lock()
_out: IO[str] | None = None
_pid = 0


def mark(event: str, req: str | None = None, **fields: Any) -> None:
    """Record trace point ``event`` now, of request ``req`` where it is one request's, with ``fields``."""
    if not ON:
        return
    t = time.monotonic()
    _write(json.dumps({"t": t, "event": event, "req": req, "thread": threading.current_thread().name, **fields}))


def mark_all(event: str, reqs: Any, **fields: Any) -> None:
    """``mark`` for each of ``reqs`` (request ids), at one instant."""
    if not ON:
        return
    t, thread = time.monotonic(), threading.current_thread().name
    for req in reqs:
        _write(json.dumps({"t": t, "event": event, "req": req, "thread": thread, **fields}))


def _write(line: str) -> None:
    global _out, _pid
    with _lock:
        if _out is None or _pid != os.getpid():  # a forked child writes a file of its own
            _pid = os.getpid()
            assert _DIR is not None  # points write only when ON
            _out = (_DIR / f"trace-{_pid}.jsonl").open("a", buffering=1)
        _out.write(line + "\n")
