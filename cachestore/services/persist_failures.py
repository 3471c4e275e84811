"""What keeps chunks from becoming persistent, and when the write-behind tries them again.

A chunk the write-behind could not persist (no room on the NVMe tier, a disk error, an index that refuses
writes, a DRAM copy that could not be read for a while) stays in DRAM, where its publisher soft-pinned it and
demotion never takes an unpersisted chunk, and its feed event stays unacknowledged. Each failed attempt is
counted by reason (``prefixcache_persist_failures_total``); while the last attempt failed the node reports itself
degraded, and the write-behind replays its pending events after a backoff doubling from 0.1 s to 5 s, so
persistence resumes by itself once the cause is gone, without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: enospc: no room on the NVMe tier (its filesystem's or its capacity's, every unpinned chunk evicted);
#: eio: the disk failed a write; index: the index refused a write or could not be reached; dram: the chunk's DRAM copy
#: could not be read though the pool may hold it (Mooncake's master or segment owner slow or unreachable); bucket:
#: the object tier refused a copy or could not be reached; error: anything else.
PersistFailureReason = Literal["enospc", "eio", "index", "dram", "bucket", "error"]
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 5.0


@dataclass
class PersistFailures:
    """Counts by reason, and the failure going on now (None once an attempt succeeds)."""

    counts: dict[PersistFailureReason, int] = field(default_factory=dict)
    failing: PersistFailureReason | None = None
    detail: str = ""
    backoff_s: float = 0.0
    retry_at: float = 0.0  # time.monotonic() of the next attempt
    attempts_failed: int = 0

    def failed(self, reason: PersistFailureReason, detail: str, chunks: int, now: float) -> None:
        """An attempt to persist ``chunks`` chunks failed: count them and push the next attempt back."""
        self.counts[reason] = self.counts.get(reason, 0) + chunks
        self.failing, self.detail = reason, detail
        self.backoff_s = min(MAX_RETRY_S, self.backoff_s * 2) if self.backoff_s else FIRST_RETRY_S
        self.retry_at = now + self.backoff_s
        self.attempts_failed += 1

    def succeeded(self) -> None:
        self.failing, self.detail, self.backoff_s = None, "", 0.0

    def wait_s(self, now: float) -> float:
        """How long the next attempt must wait (0 when nothing is failing)."""
        return max(0.0, self.retry_at - now) if self.failing else 0.0
