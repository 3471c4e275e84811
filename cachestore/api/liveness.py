"""``GET /v1/live``: whether this daemon's own process works, for liveness probes (open, like ``/v1/health``).

Liveness and readiness answer different questions. ``/v1/health`` (readiness) is ready only while every
component answers, the shared Redis and master included; a liveness probe on it restarted every daemon of a
cluster when one shared Redis failed, and each restart wiped that node's DRAM segment. A restart helps only
when this process itself is stuck, so ``/v1/live`` answers 200 while its event loop answers (the handler runs
on it) and its supervisor runs (cachestore/node/supervisor.py), which brings back the servers it started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel


class Liveness(BaseModel):
    status: Literal["alive", "stuck"]


def liveness_router(supervisor_alive: Callable[[], bool]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/live", response_model=Liveness, responses={503: {"model": Liveness}})
    async def live(response: Response) -> Liveness:
        """200 while the daemon's event loop and its supervisor run; not about the shared components."""
        alive = supervisor_alive()
        response.status_code = 200 if alive else 503
        return Liveness(status="alive" if alive else "stuck")

    return router
