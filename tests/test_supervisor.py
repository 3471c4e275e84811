"""The supervisor on its own, with real processes: reaping, restarts, backoff, hooks, and its thread's life."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from prefixcache.cachestore.host.processes import ManagedProcess, find_executable
from prefixcache.cachestore.node.supervisor import Supervisor
from prefixcache.cachestore.node.supervisor import log as supervisor_log
from tests.daemon_harness import is_zombie, wait_for


def sleeper(tmp_path: Path) -> ManagedProcess:
    return ManagedProcess("sleeper", [find_executable("sleep"), "600"], tmp_path / "sleeper.log", lambda: True)


@pytest.fixture
def supervised(tmp_path):
    process = sleeper(tmp_path)
    process.start()
    supervisor = Supervisor(interval_s=0.05, min_backoff_s=0.2, max_backoff_s=0.8, stable_s=2.0)
    yield supervisor, process
    supervisor.stop()
    process.stop()


def test_a_killed_server_is_reaped_restarted_and_counted_with_its_hook_run_while_it_is_down(supervised):
    supervisor, process = supervised
    seen_alive_in_hook = []
    supervisor.watch(process, before_restart=lambda: seen_alive_in_hook.append(process.alive()))
    supervisor.start()
    first = process.pid
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: supervisor.trouble("sleeper") is not None, 2)
    assert supervisor.trouble("sleeper").startswith("sleeper was killed by SIGKILL")
    assert not is_zombie(first)
    assert wait_for(lambda: supervisor.restarts == {"sleeper": 1}, 5)
    assert process.alive() and process.pid != first and seen_alive_in_hook == [False]
    assert supervisor.trouble("sleeper") is None and supervisor.alive()


def test_a_server_that_dies_again_soon_waits_longer_each_time(supervised, caplog):
    """The pauses it chooses double up to the cap (its log says them), and none is cut short: a pause measured from
    the kill to the restart also holds the restart's own time, which a loaded machine makes long, so only its lower
    bound is asserted by the clock."""
    supervisor, process = supervised
    supervisor.watch(process)
    supervisor.start()
    pauses = []
    with caplog.at_level(logging.ERROR, logger=supervisor_log.name):
        for restarts in range(1, 5):
            os.kill(process.pid, signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda n=restarts: supervisor.restarts["sleeper"] == n, 10)
            pauses.append(time.monotonic() - killed)
    chosen = [m.split("restarting it in ")[1] for m in caplog.messages if "restarting it in" in m]
    assert chosen == ["0.2s", "0.4s", "0.8s", "0.8s"]  # doubling, capped at 0.8
    assert all(pause >= float(s[:-1]) for pause, s in zip(pauses, chosen, strict=True)), pauses


def test_a_failing_restart_is_retried_and_reported(supervised):
    supervisor, process = supervised
    failures = []

    def flaky() -> None:
        if len(failures) < 2:
            failures.append(1)
            raise ConnectionError("index unreachable")

    supervisor.watch(process, before_restart=flaky)
    supervisor.start()
    os.kill(process.pid, signal.SIGKILL)
    assert wait_for(lambda: "last try: index unreachable" in (supervisor.trouble("sleeper") or ""), 3)
    assert wait_for(lambda: supervisor.restarts == {"sleeper": 1}, 5)
    assert len(failures) == 2 and process.alive()


def test_servers_it_restarted_outlive_the_end_of_its_loop_until_it_is_stopped(supervised):
    """Their parent-death signal follows the thread that forked them: the daemon stops them first, in order."""
    supervisor, process = supervised
    supervisor.watch(process)
    supervisor.start()
    os.kill(process.pid, signal.SIGKILL)
    assert wait_for(lambda: supervisor.restarts == {"sleeper": 1}, 5)
    supervisor.request_stop()
    time.sleep(0.3)
    assert process.alive() and not supervisor.alive()
    supervisor.stop()
    assert wait_for(lambda: not process.alive(), 5)  # SIGTERM from the kernel once its parent thread ended
