"""The connector's attachment to the store, made without ever holding vLLM up.

An engine must serve whatever the store does. When the node daemon (``GET /v1/config``), Redis or the
Mooncake master cannot be reached as the engine starts, the connector logs one warning and runs as if no
cache existed: every lookup a miss, nothing published, every request computed. A thread keeps trying to
attach, at growing intervals up to a bound, and once it has, hits resume without a restart. A store that
goes away later is not detached from: its failures are misses where they happen (lookups, loads, publishes)
and it serves again when it is back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("prefixcache.connector")

T = TypeVar("T")
#: Seconds between attempts: the first retry, and the most it grows to (doubling each time).
RETRY_S = (0.5, 8.0)


class Attachment(Generic[T]):
    """``attach()`` tried at once, then in the background until it succeeds; ``value`` is None until then.
    ``close`` releases what ``attach`` made, when the attachment is closed."""

    def __init__(
        self, attach: Callable[[], T], close: Callable[[T], None], what: str, retry_s: tuple[float, float] = RETRY_S
    ) -> None:
        self._attach, self._close, self._what, self._retry_s = attach, close, what, retry_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # an attach that succeeds while the attachment is closed is released
        self._thread: threading.Thread | None = None
        self.value: T | None = None
        try:
            self.value = attach()
        except Exception as exc:  # noqa: BLE001 - the engine must start: it serves without the cache meanwhile
            log.warning(
                "prefixcache: the %s cannot attach to the store (%s); running without the cache, "
                "retrying in the background",
                what,
                exc,
            )
            self._thread = threading.Thread(target=self._retry, name="prefixcache-attach", daemon=True)
            self._thread.start()

    def _retry(self) -> None:
        delay, longest = self._retry_s
        while not self._stop.wait(delay):
            try:
                value = self._attach()
            except Exception as exc:  # noqa: BLE001 - tried again later
                log.debug("prefixcache: the %s still cannot attach to the store: %s", self._what, exc)
                delay = min(delay * 2, longest)
                continue
            with self._lock:
                if self._stop.is_set():
                    self._close(value)
                    return
                self.value = value
            log.info("prefixcache: the %s attached to the store: loads and publishes resume", self._what)
            return

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            value, self.value = self.value, None
        if self._thread is not None:
            self._thread.join()
        if value is not None:
            self._close(value)
