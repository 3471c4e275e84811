"""Fixtures for tests that run real vLLM engines, each in a fresh process (see tests/e2e/run_vllm.py)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.e2e.launch import REPO, RESERVED_CPUS, run_engine, vllm_env
from tests.e2e.run_vllm import ranks_of
from tests.e2e.tinymodel import ENGINE_DTYPE, build_tiny_llama

__all__ = ["REPO", "vllm_env"]  # engine helpers other e2e modules import from here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is an e2e test (``-m "not e2e"`` skips them all)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, built once per session (or reused from ``$PREFIXCACHE_TEST_MODEL_DIR``)."""
    directory = os.environ.get("PREFIXCACHE_TEST_MODEL_DIR")
    return build_tiny_llama(Path(directory) if directory else tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def run_vllm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``run_vllm(spec, timeout_s=600, env=None, launcher=()) -> dict``: one engine in a fresh process, its OUT.json
    (``launcher``: what the process runs under, as ``run_engine`` takes it).

    The spec and result formats are in tests/e2e/run_vllm.py; the model's dtype is ``ENGINE_DTYPE`` unless the
    spec names one (tests/e2e/tinymodel.py), and reference engines run in one process (``is_reference``). The
    process's stdout and stderr (vLLM's log and the connector's) go to a file whose path is returned as
    ``result["log_path"]``; on failure or timeout the assertion message carries its tail. A timeout kills the
    whole process group (engine core and workers too).
    """
    workdir = tmp_path_factory.mktemp("vllm-runs")
    counter = itertools.count()

    def run(
        spec: dict, timeout_s: float = 600, env: dict[str, str] | None = None, launcher: Sequence[str] = ()
    ) -> dict:
        defaults = {"dtype": ENGINE_DTYPE, "in_process": is_reference(spec)}
        return run_engine({**defaults, **spec}, workdir, f"run-{next(counter)}", timeout_s, env, launcher)

    return run


def is_reference(spec: dict) -> bool:
    """An engine of one rank without a connector: it only gives the answers the engines under test must match,
    so it runs in one process (``in_process``), which saves two imports of vLLM. Only where vLLM would give its
    worker process one core (two cores, one reserved: tests/e2e/launch.py), which is how ``in_process``
    computes; on a larger machine it runs as the others do."""
    one_compute_core = len(os.sched_getaffinity(0)) - RESERVED_CPUS == 1
    return spec.get("kv_transfer_config") is None and ranks_of(spec) == 1 and one_compute_core
