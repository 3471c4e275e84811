"""The connector's settings (``kv_connector_extra_config``) and where its threads run: pure logic."""

from __future__ import annotations

import os
import threading

import pytest

from connector.io_threads import io_cpus, pinning
from connector.settings import ConnectorSettings
from indexer.errors import ConfigError


def test_defaults_need_only_the_service_url():
    settings = ConnectorSettings.parse({"service_url": "http://127.0.0.1:8600"})
    assert settings.io_cpus == "auto" and settings.arena_mb == 512


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({}, "service_url"),
        ({"service_url": "http://x", "arena_mb": 1}, "arena_mb"),
        ({"service_url": "http://x", "servce_url": "http://y"}, "servce_url"),
        ({"service_url": "http://x", "io_cpus": "all"}, "io_cpus"),
        ({"service_url": "http://x", "io_cpus": [-1]}, "io_cpus"),
        ({"service_url": "http://x", "io_cpus": []}, "io_cpus"),
    ],
)
def test_bad_settings_are_named_in_the_error(extra, problem):
    with pytest.raises(ConfigError, match=problem):
        ConnectorSettings.parse(extra)


def test_auto_moves_connector_threads_off_a_cpu_workers_compute_cores():
    assert io_cpus("auto", on_cpu_backend=True, compute={0}, online=range(2)) == {1}
    assert io_cpus("auto", on_cpu_backend=True, compute={0, 1, 2}, online=range(8)) == {3, 4, 5, 6, 7}


def test_auto_leaves_threads_alone_off_the_cpu_backend_or_with_no_spare_core():
    assert io_cpus("auto", on_cpu_backend=False, compute={0}, online=range(2)) is None
    assert io_cpus("auto", on_cpu_backend=True, compute={0, 1}, online=range(2)) is None
    assert io_cpus("inherit", on_cpu_backend=True, compute={0}, online=range(2)) is None


def test_an_explicit_list_is_used_as_given():
    assert io_cpus([3, 5], on_cpu_backend=False, compute={0}, online=range(8)) == {3, 5}


def test_pinning_binds_only_the_thread_that_runs_it():
    before = os.sched_getaffinity(0)
    target = frozenset({min(before)})
    seen: list[set[int]] = []

    def run() -> None:
        pinning(target)()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [set(target)] and os.sched_getaffinity(0) == before


def test_a_refused_binding_leaves_the_thread_where_it_was(caplog):
    before = os.sched_getaffinity(0)
    pinning(frozenset({100_000}))()  # no such CPU
    assert os.sched_getaffinity(0) == before and "cannot bind" in caplog.text
