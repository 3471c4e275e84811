"""Tracing a hit's path through the connector, for benchmarks/hit_budget.py: off unless the environment variable
``PREFIXCACHE_TRACE_DIR`` names a directory when the connector is imported. ``PREFIXCACHE_TRACE_WHAT`` then says
what is recorded there:

- ``points`` (the default): trace points (``mark``) along a hit's path and a publish's, a line each.
- ``hooks``: no points; the connector's hooks that ``timed`` wraps add their time up per process, and each
  ``timed_step_end`` hook writes what they took since the last one as a single point (``"timed": {name:
  seconds}``): the connector's own time in each step, at one point per step, which costs the step far less than a
  point per hook would, and nothing inside the time it measures.

Each process that records writes ``trace-<pid>.jsonl`` there, a line per point: ``{"t": time.monotonic(), "event":
name, "req": request id or null, "thread": the thread's name, ...}``. ``time.monotonic`` is one clock for every
process of a host, the clock of vLLM's own engine-core timestamps (``RequestStateStats``), so a benchmark lines the
points of the scheduler's and the workers' processes up with vLLM's own. Off, a point costs a call and one test of
a module-level flag, and a ``timed`` hook is the hook itself.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from prefixcache.indexer.errors import ConfigError

TRACE_DIR_ENV = "PREFIXCACHE_TRACE_DIR"
TRACE_WHAT_ENV = "PREFIXCACHE_TRACE_WHAT"
_DIR = Path(os.environ[TRACE_DIR_ENV]) if os.environ.get(TRACE_DIR_ENV) else None
_WHAT = os.environ.get(TRACE_WHAT_ENV) or "points"
if _WHAT not in ("points", "hooks"):
    raise ConfigError(f"{TRACE_WHAT_ENV} must be 'points' or 'hooks', not {_WHAT!r}")
ON = _DIR is not None and _WHAT == "points"  # trace points are written
HOOKS = _DIR is not None and _WHAT == "hooks"  # hooks are timed
_lock = threading.Lock()
_out: IO[str] | None = None
_pid = 0
_timed: dict[str, float] = {}  # seconds per ``timed`` hook since the last step's end

Hook = TypeVar("Hook", bound=Callable[..., Any])


def mark(event: str, req: str | None = None, **fields: Any) -> None:
    """Record trace point ``event`` now, of request ``req`` where it is one request's, with ``fields``."""
    if not ON:
        return
    _record(time.monotonic(), event, req, **fields)


def mark_all(event: str, reqs: Any, **fields: Any) -> None:
    """``mark`` for each of ``reqs`` (request ids), at one instant."""
    if not ON:
        return
    t = time.monotonic()
    for req in reqs:
        _record(t, event, req, **fields)


def timed(hook: Hook) -> Hook:
    """``hook`` itself unless hooks are timed (decided at import: no cost); then ``hook`` adding the time of each
    call to what the next ``timed_step_end`` hook writes."""
    return _timing(hook, step_end=False)


def timed_step_end(hook: Hook) -> Hook:
    """``timed``, for a hook called once per step: after each call, the point ``timed`` of what every timed hook
    of this process took since the last such point (its writing outside the time measured)."""
    return _timing(hook, step_end=True)


def _timing(hook: Hook, step_end: bool) -> Hook:
    if not HOOKS:
        return hook
    name = hook.__name__

    @functools.wraps(hook)
    def timed_hook(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return hook(*args, **kwargs)
        finally:
            end = time.monotonic()
            _timed[name] = _timed.get(name, 0.0) + end - start
            if step_end:
                spent = dict(_timed)
                _timed.clear()
                _record(end, "timed", None, timed=spent)

    return cast(Hook, timed_hook)


def _record(t: float, event: str, req: str | None, **fields: Any) -> None:
    """Write point ``event`` at ``t`` as the line the module's docstring describes."""
    _write(json.dumps({"t": t, "event": event, "req": req, "thread": threading.current_thread().name, **fields}))


def _write(line: str) -> None:
    global _out, _pid
    with _lock:
        if _out is None or _pid != os.getpid():  # a forked child writes a file of its own
            _pid = os.getpid()
            assert _DIR is not None  # only while tracing
            _out = (_DIR / f"trace-{_pid}.jsonl").open("a", buffering=1)
        _out.write(line + "\n")
