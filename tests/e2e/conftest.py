"""Fixtures for tests that run real vLLM engines, each in a fresh process (see tests/e2e/run_vllm.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.tinymodel import build_tiny_llama

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 6000


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


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process runs in: offline, 1 GiB of KV cache, one CPU reserved."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        **(extra or {}),
    }


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-LOG_TAIL_CHARS:]


@pytest.fixture(scope="session")
def run_vllm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``run_vllm(spec, timeout_s=600, env=None) -> dict``: one engine in a fresh process, its OUT.json.

    The spec and result formats are in tests/e2e/run_vllm.py. The process's stdout and stderr (vLLM's log and the
    connector's) go to a file whose path is returned as ``result["log_path"]``; on failure or timeout the
    assertion message carries its tail. A timeout kills the whole process group (engine core and workers too).
    """
    workdir = tmp_path_factory.mktemp("vllm-runs")
    counter = itertools.count()

    def run(spec: dict, timeout_s: float = 600, env: dict[str, str] | None = None) -> dict:
        n = next(counter)
        spec_path, out_path, log_path = (workdir / f"{name}-{n}.{ext}" for name, ext in
                                         (("spec", "json"), ("out", "json"), ("log", "txt")))  # fmt: skip
        spec_path.write_text(json.dumps(spec))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.run_vllm", str(spec_path), str(out_path)],
                cwd=REPO, env=vllm_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise AssertionError(
                    f"vLLM run {n} timed out after {timeout_s} s (log {log_path}):\n{_tail(log_path)}"
                ) from None
            finally:
                _kill_leftovers(proc.pid)
        assert rc == 0 and out_path.exists(), f"vLLM run {n} exited {rc} (log {log_path}):\n{_tail(log_path)}"
        result = json.loads(out_path.read_text())
        result["log_path"] = str(log_path)
        return result

    return run


def _kill_leftovers(pgid: int) -> None:
    """Engine processes that outlived a finished run (they share its process group) are killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
