"""A warm-up's running counts, shown as a rich progress bar and mirrored to a JSON file for the daemon.

The daemon runs a job in a child process and answers ``GET /v1/warmup/{id}`` from that file, so it
is replaced atomically on every update: a reader sees the previous or the next snapshot, never half.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, computed_field
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Phase = Literal["reading corpus", "starting engine", "warming", "stopping engine", "done"]


class Counters(BaseModel):
    prompts_total: int = 0  # prompts in the corpus that parsed
    prompts_done_before: int = 0  # recorded by earlier runs of the job
    prompts_warmed: int = 0
    prompts_cached: int = 0  # skipped: already in the index when looked up
    prompts_failed: int = 0  # computed, but their chunks never showed up in the index (retried next run)
    prompts_invalid: int = 0  # left out: bad input (with --on-error skip)
    tokens_computed: int = 0
    tokens_reused: int = 0  # prefix blocks shared between prompts of this run (vLLM's own prefix cache)
    tokens_skipped: int = 0  # tokens of prompts skipped as already cached
    chunks_added: int = 0
    bytes_added: int = 0

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented form; mypy rejects decorated properties
    @property
    def prompts_done(self) -> int:
        return self.prompts_done_before + self.prompts_warmed + self.prompts_cached + self.prompts_invalid


class Snapshot(BaseModel):
    phase: Phase
    counters: Counters
    elapsed_s: float
    eta_s: float | None


def eta(counters: Counters, warming_s: float, done_at_start: int) -> float | None:
    """Seconds left at this run's rate so far (None until a prompt was done in this run)."""
    done_here = counters.prompts_done - done_at_start
    left = counters.prompts_total - counters.prompts_done
    return None if done_here <= 0 else warming_s / done_here * left


class ProgressReporter:
    """Shows each snapshot on a console (a progress bar) and writes it to a file, either optional."""

    def __init__(self, console: Console | None, path: Path | None) -> None:
        self.path = path
        self.started = time.monotonic()
        self._bar: Progress | None = None
        self._task = None
        if console is not None:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("prompts"),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=console,
            )
            self._task = self._bar.add_task("warm-up", total=None, detail="", eta="-")
            self._bar.start()

    def update(self, phase: Phase, counters: Counters, eta_s: float | None = None) -> None:
        if self._bar is not None and self._task is not None:
            detail = (
                f"{counters.tokens_computed:,} tok computed, {counters.tokens_skipped:,} skipped (cached), "
                f"{counters.chunks_added} chunks / {_mib(counters.bytes_added)} stored"
            )
            self._bar.update(
                self._task,
                description=phase,
                total=counters.prompts_total or None,
                completed=counters.prompts_done,
                detail=detail,
                eta="-" if eta_s is None else f"{eta_s:.0f}s",
            )
        if self.path is not None:
            snapshot = Snapshot(phase=phase, counters=counters, elapsed_s=time.monotonic() - self.started, eta_s=eta_s)
            write_atomically(self.path, snapshot.model_dump_json())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
