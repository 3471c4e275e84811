"""A warm-up job's state file: which prompts are done, so an interrupted job resumes and a finished one does nothing.

A job is identified by a digest of everything that decides what it stores (the corpus bytes, the
model and its fingerprint, the tokenizer, the default tenant, the engine options, the index it
writes to); change any of them and it is another job, whose prompts are then skipped by their
index lookups instead. The file is replaced atomically (temp file, fsync, rename), so an interrupt
at any moment leaves the previous or the next version, never a torn one. A prompt is recorded only
after its chunks were seen in the index. One process at a time runs a job (an flock on a lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ValidationError

from prefixcache.indexer.errors import ConfigError, PrefixCacheError

STATE_VERSION = 1
#: warmed: computed by this job; cached: already in the index when looked up; invalid: left out (bad input)
Outcome = Literal["warmed", "cached", "invalid"]


class JobBusyError(PrefixCacheError, RuntimeError):
    """Another process is running the same job right now."""


class JobState(BaseModel):
    version: int = STATE_VERSION
    job_id: str
    corpus: str
    model: str
    #: digest of the connector's namespace (the first shard's), recorded once the engine reported it
    namespace: str | None = None
    outcomes: dict[str, Outcome] = {}
    created_s: float
    updated_s: float

    def pending(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k not in self.outcomes]


def job_id(inputs: dict[str, Any]) -> str:
    """A short digest of the job's defining inputs (canonical JSON)."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())[:20]


class StateFile:
    def __init__(self, directory: Path, job: str) -> None:
        self.directory = directory
        self.job = job
        self.path = directory / f"{job}.json"

    def load_or_new(self, corpus: str, model: str) -> JobState:
        if not self.path.exists():
            now = time.time()
            return JobState(job_id=self.job, corpus=corpus, model=model, created_s=now, updated_s=now)
        try:
            state = JobState.model_validate_json(self.path.read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read warm-up state {self.path}: {exc.strerror}") from exc
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ConfigError(f"warm-up state {self.path} is damaged ({reason}); delete it to start over") from None
        if state.job_id != self.job or state.version != STATE_VERSION:
            raise ConfigError(f"warm-up state {self.path} belongs to job {state.job_id} v{state.version}; delete it")
        return state

    def save(self, state: JobState) -> None:
        state.updated_s = time.time()
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(state.model_dump_json(indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the job's lock for the whole run; a second runner of the same job is refused, not queued."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"{self.job}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise JobBusyError(f"warm-up job {self.job} is already running in another process") from None
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
