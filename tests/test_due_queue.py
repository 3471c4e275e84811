"""The background thread's queue: jobs due later wait, jobs queued after them run first, and closing hands out
every job left."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from prefixcache.connector.due_queue import DueQueue


def test_a_job_due_later_waits_while_jobs_queued_after_it_are_handed_out():
    jobs: DueQueue[str] = DueQueue(8)
    jobs.put_nowait("store", due=time.monotonic() + 0.2)
    jobs.put_nowait("publish")
    assert jobs.get() == "publish"
    assert jobs.get() == "store"


def test_a_job_is_not_handed_out_before_it_is_due():
    jobs: DueQueue[str] = DueQueue(8)
    due = time.monotonic() + 0.1
    jobs.put_nowait("store", due=due)
    assert jobs.get() == "store"
    assert time.monotonic() >= due


def test_jobs_due_at_once_keep_their_order():
    jobs: DueQueue[int] = DueQueue(8)
    for job in range(5):
        jobs.put_nowait(job)
    assert [jobs.get() for _ in range(5)] == list(range(5))


def test_jobs_waiting_when_the_queue_closes_are_handed_out_at_once_in_due_order():
    jobs: DueQueue[str] = DueQueue(8)
    later = time.monotonic() + 60
    jobs.put_nowait("second", due=later + 1)
    jobs.put_nowait("first", due=later)
    jobs.close()
    started = time.monotonic()
    assert [jobs.get(), jobs.get(), jobs.get()] == ["first", "second", None]
    assert time.monotonic() - started < 30, "closing waited for jobs due a minute later"


def test_a_job_put_while_the_consumer_waits_for_a_later_one_is_handed_out_first():
    jobs: DueQueue[str] = DueQueue(8)
    jobs.put_nowait("store", due=time.monotonic() + 60)
    got: list[str | None] = []
    consumer = threading.Thread(target=lambda: got.append(jobs.get()))
    consumer.start()
    time.sleep(0.05)  # the consumer now waits for the store to be due
    jobs.put_nowait("publish")
    consumer.join(timeout=30)
    assert got == ["publish"]
    jobs.close()


def test_a_full_queue_refuses_a_job():
    jobs: DueQueue[int] = DueQueue(2)
    jobs.put_nowait(1)
    jobs.put_nowait(2)
    with pytest.raises(queue.Full):
        jobs.put_nowait(3)
