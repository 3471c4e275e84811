"""SharedChecks (connector/loaders/dram_in_place.py): a read's chunks verified by two threads side by side, each
chunk once, every verdict in its place."""

from __future__ import annotations

import threading
import time

from prefixcache.connector.loaders.dram_in_place import SharedChecks


def test_two_threads_verify_every_chunk_once_and_the_verdicts_keep_their_order() -> None:
    checked: list[int] = []
    lock = threading.Lock()

    def check(item: int) -> bool:
        time.sleep(0.002)
        with lock:
            checked.append(item)
        return item % 3 != 0  # chunks 0, 3, 6, 9 are damaged

    checks = SharedChecks(12, check)
    helper = threading.Thread(target=checks.run, kwargs={"from_back": True})
    helper.start()
    checks.run()
    verdicts = checks.wait()
    helper.join()
    assert sorted(checked) == list(range(12))
    assert verdicts == [i % 3 != 0 for i in range(12)]


def test_the_verdict_waits_for_the_chunk_the_other_thread_is_verifying() -> None:
    started, release = threading.Event(), threading.Event()

    def check(item: int) -> bool:
        if item == 1:  # the helper's, from the back
            started.set()
            release.wait(5)
        return True

    checks = SharedChecks(2, check)
    helper = threading.Thread(target=checks.run, kwargs={"from_back": True})
    helper.start()
    started.wait(5)
    checks.run()  # takes chunk 0; chunk 1 is still being verified
    waiter = threading.Thread(target=checks.wait)
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()
    release.set()
    waiter.join(5)
    helper.join(5)
    assert not waiter.is_alive() and checks.intact == [True, True]
