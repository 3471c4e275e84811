"""Buffers that callers fill in O(1) and a lazily started thread empties every ``interval_s``.

Hit statistics (the index's access log) and client stats share this shape: recording must
never wait on Redis, so records collect in memory and ``flush`` writes them in the background;
``close`` stops the thread and writes what is left. The thread is a ``PeriodicLoop``, so a failing
flush is logged (rate-limited) and the next one still runs, as in every other background thread.
"""

from __future__ import annotations

import threading

from prefixcache.indexer.background_loop import PeriodicLoop


class PeriodicFlusher(PeriodicLoop):
    name = "prefixcache-flusher"

    def __init__(self, interval_s: float) -> None:
        super().__init__(interval_s)
        self._start_lock = threading.Lock()

    def flush(self) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        self.flush()

    @property
    def closed(self) -> bool:
        return self.stopping

    def _started(self) -> None:
        """Start the flushing thread on first use (a process that records nothing never runs one)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self.start()

    def close(self) -> None:
        self.stop()
        self.flush()
