"""The daemon's warm-up jobs: each runs ``prefixcache warmup`` in a child process, one job at a time.

A child process because a vLLM engine owns its process (worker processes, accelerator memory,
signal handlers) and gives its memory back only by exiting: the daemon must outlive any engine.
One at a time because two engines on one node would compete for the same memory. The child writes
progress snapshots to a file (``--progress-file``) and its report to stdout (``--json``); the
daemon reads those, never its log. Cancelling sends SIGTERM to the child, which stops its engine
and keeps its state, so submitting the same job again resumes it; a child still running after
``CANCEL_GRACE_S`` is killed with its engine. Children die with the daemon (PR_SET_PDEATHSIG, set by
the long-lived runner thread that starts them). The job list is in memory only: the job's state
file, not this list, is what makes work survive a restart.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prefixcache.cachestore.host.processes import die_with_parent
from prefixcache.cachestore.warmup.policy import TENANT_ENV, WarmupPolicy, scrubbed_environment
from prefixcache.cachestore.warmup.progress import Snapshot
from prefixcache.cachestore.warmup.report import Report
from prefixcache.indexer.errors import PrefixCacheError

CANCEL_GRACE_S = 60.0
LOG_TAIL_LINES = 30
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
M = TypeVar("M", bound=BaseModel)


class WarmupRequest(BaseModel):
    """``POST /v1/warmup``: what ``prefixcache warmup`` takes, with paths on the daemon's machine, inside the
    daemon's warm-up roots (``policy``)."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field(
        min_length=1,
        max_length=4096,
        description="absolute path, in a warm-up root, of a JSONL file or a folder of text files",
    )
    model: str = Field(min_length=1, max_length=4096, description="absolute path of the model in a warm-up root")
    tokenizer: str | None = Field(default=None, min_length=1, max_length=4096, description="as model")
    tenant: str | None = Field(default=None, min_length=1, description="cache_salt of lines without their own")
    on_error: Literal["skip", "fail"] = "fail"
    batch_size: int = Field(default=16, ge=1, le=4096)
    max_prompts: int | None = Field(default=None, ge=1)
    arena_mb: int | None = Field(default=None, ge=16, le=1 << 20)
    engine_options: list[str] = Field(default=[], max_length=256, description="vllm serve options, e.g. --dtype")

    @field_validator("engine_options")
    @classmethod
    def _plain_strings(cls, options: list[str]) -> list[str]:
        if any("\0" in o or len(o) > 4096 for o in options):
            raise ValueError("options must be strings without NUL, at most 4096 characters each")
        return options


class WarmupJob(BaseModel):
    id: str
    status: JobStatus
    request: WarmupRequest = Field(description="as submitted, with the tenant salt masked")
    submitted_s: float
    started_s: float | None = None
    finished_s: float | None = None
    exit_code: int | None = None
    progress: Snapshot | None = None
    report: Report | None = None
    error: str | None = Field(default=None, description="the end of the job's log when it failed")


class JobNotFoundError(PrefixCacheError, KeyError):
    """No warm-up job has the id asked for (404)."""


class JobFinishedError(PrefixCacheError, RuntimeError):
    """The job asked to stop has already ended (409)."""


class _Job:
    def __init__(self, job_id: str, request: WarmupRequest, directory: Path) -> None:
        self.id = job_id
        self.request = request
        self.status: JobStatus = "queued"
        self.submitted_s = time.time()
        self.started_s: float | None = None
        self.finished_s: float | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.cancel_requested = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.progress_path = directory / f"{job_id}.progress.json"
        self.report_path = directory / f"{job_id}.report.json"
        self.log_path = directory / f"{job_id}.log"


class WarmupJobs:
    def __init__(
        self,
        directory: Path,
        service_url: str,
        state_dir: Path,
        engine_cpus: frozenset[int] | None = None,
        policy: WarmupPolicy | None = None,
        redis_password: str | None = None,
    ) -> None:
        """``engine_cpus``: the CPUs a job's engine runs on (None: the daemon's own); ``policy``: what jobs may run
        (None: nothing, no warm-up roots); ``redis_password``: the index's, handed to each child on its stdin."""
        self.directory = directory
        self.policy = policy or WarmupPolicy()
        self._redis_password = redis_password
        self.engine_cpus = engine_cpus
        self.service_url = service_url
        self.state_dir = state_dir
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._runner = threading.Thread(target=self._run_queue, name="prefixcache-warmup", daemon=True)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._runner.start()

    def stop(self) -> None:
        """Cancel every job and wait for the running one's child to exit."""
        for job in list(self._jobs.values()):
            with contextlib.suppress(JobFinishedError):
                self.cancel(job.id)
        self._queue.put(None)
        self._runner.join(CANCEL_GRACE_S + 5)

    def submit(self, request: WarmupRequest) -> WarmupJob:
        """Queue ``request`` once the policy allows it (``WarmupRefusedError`` otherwise), with its paths resolved."""
        request = self.admit(request)
        job = _Job(secrets.token_hex(6), request, self.directory)
        with self._lock:
            self._jobs[job.id] = job
        self._queue.put(job)
        return self._view(job)

    def admit(self, request: WarmupRequest) -> WarmupRequest:
        """``request`` if the policy allows it, its corpus resolved (the child reads what was checked). The model
        and tokenizer keep the path as given once it checked out: vLLM names the namespace after it, so the job
        stores its chunks where a server started with that same path looks them up."""
        p = self.policy
        p.check_options(request.engine_options)
        p.resolve("model", request.model)
        if request.tokenizer is not None:
            p.resolve("tokenizer", request.tokenizer)
        return request.model_copy(update={"corpus": p.resolve("corpus", request.corpus)})

    def get(self, job_id: str) -> WarmupJob:
        return self._view(self._job(job_id))

    def all_jobs(self) -> list[WarmupJob]:
        return [self._view(job) for job in list(self._jobs.values())]

    def cancel(self, job_id: str) -> WarmupJob:
        job = self._job(job_id)
        with self._lock:
            if job.status in ("succeeded", "failed", "cancelled"):
                raise JobFinishedError(f"warm-up job {job_id} already {job.status}")
            job.cancel_requested = True
            if job.status == "queued":
                job.status, job.finished_s = "cancelled", time.time()
            elif job.proc is not None and job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)  # the child stops its engine and keeps its state
                deadline = threading.Timer(CANCEL_GRACE_S, _kill_group, args=(job.proc,))
                deadline.daemon = True
                deadline.start()
        return self._view(job)

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(job_id)
        return job

    # -- the runner thread -----------------------------------------------------------------------------

    def _run_queue(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                if job.cancel_requested:
                    continue
                job.status, job.started_s = "running", time.time()
                job.proc = self._spawn(job)
            code = job.proc.wait()
            _kill_group(job.proc)  # engine processes that outlived their parent
            with self._lock:
                job.exit_code, job.finished_s = code, time.time()
                if job.cancel_requested:
                    job.status = "cancelled"
                elif code == 0:
                    job.status = "succeeded"
                else:
                    job.status, job.error = "failed", _tail(job.log_path)

    def _spawn(self, job: _Job) -> subprocess.Popen[bytes]:
        r = job.request
        argv = [
            sys.executable,
            "-m",
            "prefixcache.cachestore",
            "warmup",
            r.corpus,
            "--model",
            r.model,
            "--service-url",
            self.service_url,
            "--state-dir",
            str(self.state_dir),
            "--batch-size",
            str(r.batch_size),
            "--on-error",
            r.on_error,
            "--json",
            "--progress-file",
            str(job.progress_path),
        ]
        if self._redis_password:
            argv.append("--redis-password-stdin")
        for flag, value in (("--tokenizer", r.tokenizer), ("--max-prompts", r.max_prompts), ("--arena-mb", r.arena_mb)):
            if value is not None:
                argv += [flag, str(value)]
        env = {k: v for k, v in scrubbed_environment(os.environ).items() if k != TENANT_ENV}
        if r.tenant:
            env[TENANT_ENV] = r.tenant
        stdin = subprocess.PIPE if self._redis_password else subprocess.DEVNULL
        with open(job.report_path, "wb") as out, open(job.log_path, "ab") as log:
            proc = subprocess.Popen(
                [*argv, "--", *r.engine_options],
                stdout=out,
                stderr=log,
                stdin=stdin,
                env=env,
                start_new_session=True,
                preexec_fn=self._child_setup,
            )
        if proc.stdin is not None and self._redis_password:  # a line, far below a pipe's buffer: never blocks
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(self._redis_password.encode() + b"\n")
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        return proc

    def _child_setup(self) -> None:
        """Runs in the job's process before it starts: dies with the daemon, runs on the engine's CPUs."""
        die_with_parent()
        if self.engine_cpus is not None:
            os.sched_setaffinity(0, self.engine_cpus)

    # -- views ---------------------------------------------------------------------------------------------

    def _view(self, job: _Job) -> WarmupJob:
        shown = job.request.model_copy(update={"tenant": "***" if job.request.tenant else None})
        return WarmupJob(
            id=job.id,
            status=job.status,
            request=shown,
            submitted_s=job.submitted_s,
            started_s=job.started_s,
            finished_s=job.finished_s,
            exit_code=job.exit_code,
            progress=_read(job.progress_path, Snapshot),
            report=_read(job.report_path, Report) if job.finished_s else None,
            error=job.error,
        )


def local_url(host: str, port: int) -> str:
    """The daemon's URL as its own children reach it (a wildcard bind address is reached on loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _read(path: Path, model: type[M]) -> M | None:
    """A snapshot or report the child wrote (atomically), or None while there is none."""
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except OSError:
        return "(no log)"
