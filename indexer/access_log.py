"""Batched, asynchronous recording of lookup hits (last-access time and hit count).

Writing two fields per hit chunk inside the lookup script would triple its cost (every write is
propagated to the AOF), and a scheduler waits on every lookup. So a lookup only reads; it hands its
hits to this log in O(1), and a background thread, every ``interval_s``, folds them into one update
per distinct chunk (hot prefixes are hit by many lookups per interval). Folding counts identical
lookups first, so its Python work, which holds the GIL the scheduler needs, grows with the distinct
prefixes, not with the lookups; updates go out in slices of ``keys_per_call`` so that a lookup
never waits behind a long write script. Under overload the oldest pending records are dropped:
statistics may lag, lookups never do.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable

from prefixcache.indexer.periodic_flusher import PeriodicFlusher

log = logging.getLogger("prefixcache.index")

#: What the apply callback receives: {hex key: hits}. The index stamps the last access with its own clock.
Hits = dict[str, int]


class AccessLog(PeriodicFlusher):
    name = "prefixcache-access-log"

    def __init__(
        self,
        apply: Callable[[Hits], None],
        interval_s: float = 0.05,
        max_pending: int = 100_000,
        keys_per_call: int = 64,
    ) -> None:
        super().__init__(interval_s)
        self._apply = apply
        self._keys_per_call = keys_per_call
        self._pending: deque[str] = deque(maxlen=max_pending)
        self._lock = threading.Lock()  # one apply at a time, so flush() returns after its records land

    def record(self, hex_keys: str) -> None:
        """Note one lookup's hits (its hit keys as concatenated 32-char hex)."""
        if not hex_keys or self.closed:
            return
        self._pending.append(hex_keys)
        self._started()

    def flush(self) -> None:
        """Apply everything recorded so far, now (tests, shutdown)."""
        with self._lock:
            lookups = Counter[str]()
            while self._pending:
                lookups[self._pending.popleft()] += 1
            hits = Counter[str]()
            for hex_keys, count in lookups.items():
                for i in range(0, len(hex_keys), 32):
                    hits[hex_keys[i : i + 32]] += count
            items = list(hits.items())
            for start in range(0, len(items), self._keys_per_call):
                try:
                    self._apply(dict(items[start : start + self._keys_per_call]))
                except Exception as exc:  # noqa: BLE001 - statistics must never break lookups
                    log.debug("dropped access updates of %d chunks: %s", len(items) - start, exc)
                    return
