"""Run one vLLM engine in a fresh process (``tests/e2e/run_vllm.py``) and return its results.

Shared by the e2e fixtures and ``benchmarks/ttft.py``: both need every engine in its own process group,
the same offline environment and CPU binding, and the log's tail when a run fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 6000
RESERVED_CPUS = 1  # VLLM_CPU_NUM_OF_RESERVED_CPU of every engine (vllm_env)


class EngineRunError(AssertionError):
    """An engine process failed or timed out; the message carries its log's tail."""


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process runs in: offline, 1 GiB of KV cache, one CPU reserved.

    ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` matters beyond tests: with any KV connector configured vLLM would
    otherwise give the worker both cores of a 2-core machine (one without a connector), and a connector
    would look faster on cold prefill for free.
    """
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(RESERVED_CPUS),
        **(extra or {}),
    }


def run_engine(
    spec: dict,
    workdir: Path,
    name: str,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> dict:
    """Run ``spec`` (format in tests/e2e/run_vllm.py) in a fresh process; its OUT.json plus ``log_path``.
    ``launcher``: what the process runs under (a host of tests/netns.py's, ``Host.launcher``), which execs it."""
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log.txt"))
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "tests.e2e.run_vllm", str(spec_path), str(out_path)],
            cwd=REPO,
            env=vllm_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise EngineRunError(
                f"vLLM run {name} timed out after {timeout_s} s (log {log_path}):\n{_tail(log_path)}"
            ) from None
        finally:
            _kill_leftovers(proc.pid)
    if rc != 0 or not out_path.exists():
        raise EngineRunError(f"vLLM run {name} exited {rc} (log {log_path}):\n{_tail(log_path)}")
    result = json.loads(out_path.read_text())
    result["log_path"] = str(log_path)
    return result


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-LOG_TAIL_CHARS:]


def _kill_leftovers(pgid: int) -> None:
    """Engine processes that outlived a finished run (they share its process group) are killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
