"""``/v1/warmup``: submit, inspect and cancel warm-up jobs. Submitting and cancelling need the admin token
(``require_admin``), reading needs what every other read-only endpoint needs (``require_reader``). A job runs
only what the daemon's operator allowed (``policy``): anything else is a 400 that says which rule it broke."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, status

from prefixcache.cachestore.api.auth import require_admin, require_reader
from prefixcache.cachestore.warmup.jobs import JobFinishedError, JobNotFoundError, WarmupJob, WarmupJobs, WarmupRequest
from prefixcache.cachestore.warmup.policy import WarmupRefusedError

JOB_ID = Path(pattern=r"^[0-9a-f]{12}$", description="the id POST /v1/warmup returned")


def warmup_router(jobs: WarmupJobs) -> APIRouter:
    router = APIRouter(prefix="/v1/warmup", tags=["warm-up"], responses={404: {"description": "no such job"}})

    @router.post(
        "",
        response_model=WarmupJob,
        status_code=status.HTTP_202_ACCEPTED,
        dependencies=[Depends(require_admin)],
        responses={400: {"description": "a path outside the warm-up roots, or an engine option not allowed"}},
    )
    def submit(request: WarmupRequest) -> WarmupJob:
        """Queue a job; the daemon runs jobs one at a time, each in a child process. Same corpus, model and
        options as an earlier job: it resumes that job, and does nothing if it finished. Paths must lie in the
        daemon's warm-up roots, engine options in its allowlist."""
        try:
            return jobs.submit(request)
        except WarmupRefusedError as exc:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None

    @router.get("", response_model=list[WarmupJob], dependencies=[Depends(require_reader)])
    def list_jobs() -> list[WarmupJob]:
        """Every job since the daemon started, oldest first."""
        return jobs.all_jobs()

    @router.get("/{job_id}", response_model=WarmupJob, dependencies=[Depends(require_reader)])
    def job(job_id: Annotated[str, JOB_ID]) -> WarmupJob:
        """Status, progress (prompts, tokens, chunks, bytes, ETA) and, once finished, the report."""
        return _found(jobs.get, job_id)

    @router.delete(
        "/{job_id}",
        response_model=WarmupJob,
        dependencies=[Depends(require_admin)],
        responses={409: {"description": "the job already finished"}},
    )
    def cancel(job_id: Annotated[str, JOB_ID]) -> WarmupJob:
        """Cancel a queued or running job; a running one stops after its engine shut down, keeping its state."""
        try:
            return _found(jobs.cancel, job_id)
        except JobFinishedError as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None

    return router


def _found(action: Callable[[str], WarmupJob], job_id: str) -> WarmupJob:
    try:
        return action(job_id)
    except JobNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no warm-up job {job_id}") from None
