"""Buffers that callers fill in O(1) and a lazily started thread empties every ``interval_s``.

Hit statistics (the index's access log) and client stats share this shape: recording must
never wait on Redis, so records collect in memory and ``flush`` writes them in the background;
``close`` stops the thread and writes what is left.
"""

from __future__ import annotations

import threading


class PeriodicFlusher:
    thread_name = "prefixcache-flusher"

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def flush(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def _started(self) -> None:
        """Start the flushing thread on first use (a process that records nothing never runs one)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                    self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()
