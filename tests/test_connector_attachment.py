"""The connector's attachment: tried at once, retried in the background, released once; and its stand-in
worker side, which fails every load it is given within the step."""

from __future__ import annotations

import logging
import threading
import time

from prefixcache.connector.attachment import Attachment
from prefixcache.connector.detached_worker import DetachedWorker
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata
from tests.daemon_harness import wait_for


class FlakyStore:
    def __init__(self, failures: int) -> None:
        self.failures, self.attempts, self.closed = failures, 0, []
        self.lock = threading.Lock()

    def attach(self) -> str:
        with self.lock:
            self.attempts += 1
            if self.attempts <= self.failures:
                raise ConnectionError("store down")
            return f"client-{self.attempts}"


def test_a_reachable_store_attaches_at_once():
    store = FlakyStore(failures=0)
    attachment = Attachment(store.attach, store.closed.append, "test")
    assert attachment.value == "client-1"
    attachment.close()
    assert store.closed == ["client-1"] and attachment.value is None


def test_an_unreachable_store_warns_once_and_attaches_when_back(caplog):
    store = FlakyStore(failures=3)
    with caplog.at_level(logging.INFO, logger="prefixcache.connector"):
        attachment = Attachment(store.attach, store.closed.append, "test", retry_s=(0.01, 0.02))
        assert attachment.value is None
        assert wait_for(lambda: attachment.value == "client-4", timeout_s=5)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "running without the cache" in warnings[0].getMessage()
    attachment.close()
    assert store.closed == ["client-4"]


def test_closing_stops_the_retries():
    store = FlakyStore(failures=10**6)
    attachment = Attachment(store.attach, store.closed.append, "test", retry_s=(0.01, 0.01))
    time.sleep(0.05)
    attachment.close()
    attempts = store.attempts
    time.sleep(0.05)
    assert store.attempts == attempts and store.closed == []


def test_the_detached_worker_fails_each_planned_load_within_its_step():
    worker = DetachedWorker()
    meta = PrefixCacheMetadata(
        loads=[{"sync": [LoadChunk(b"k" * 16, 64, 0, [1, 2])], "async": [LoadChunk(b"j" * 16, 64, 0, [3])]}],
        load_async={"async"},
    )
    worker.begin_step(meta)
    worker.start_load(meta)
    worker.save(meta)
    assert not worker.idle
    assert worker.finished_async_loads() == {"async"}
    assert worker.take_load_errors() == {1, 2, 3}
    assert worker.idle and worker.transfers.take().data == {"load_failed_blocks": 3}
    worker.start_load(PrefixCacheMetadata())  # a scheduler side without the store plans nothing
    assert worker.idle
