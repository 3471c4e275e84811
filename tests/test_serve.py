"""`prefixcache serve` as a user runs it: a real process, its embedded redis-server, a clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.host.processes import (
    ManagedProcess,
    ServerStartError,
    free_port,
    free_port_block,
    port_open,
)
from prefixcache.cachestore.warmup.jobs import WarmupJobs
from tests.daemon_harness import niceness

CLI = [sys.executable, "-m", "prefixcache.cachestore"]


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_leftover_daemons():
    """A failed assertion must not leave a daemon (and its servers) running."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port_block(7)
    proc = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            str(port),
            "--dram-bytes",
            "128MiB",
            "--nvme-bytes",
            "512MiB",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _started.append(proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("serve never became ready")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI to completion with a wide terminal, so messages are not wrapped."""
    env = {**os.environ, **(env or {}), "COLUMNS": "200"}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60)


def children_of(port: int) -> list[int]:
    """PIDs of the redis-server, mooncake_master and mooncake_client a daemon on ``port`` started."""
    patterns = [f"redis-server 127.0.0.1:{port + 1}", f"rpc_port={port + 4}", f"-port={port + 2}"]
    pids = []
    for pattern in patterns:
        out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout
        pids += [int(pid) for pid in out.split()]
    return pids


def wait_until_gone(port: int, timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while children_of(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    return children_of(port)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_the_embedded_stack_reports_ready_and_stops_cleanly(tmp_path, stop_signal):
    proc, port = start_serve(tmp_path)
    health = httpx.get(f"http://127.0.0.1:{port}/v1/health").json()
    assert health["status"] == "ready"
    assert set(health["components"]) == {"redis", "mooncake_master", "dram", "nvme", "peers"}
    assert all(c["ok"] for c in health["components"].values())
    config = httpx.get(f"http://127.0.0.1:{port}/v1/config").json()
    assert config["redis_url"] == f"redis://127.0.0.1:{port + 1}/0" and config["chunk_tokens"] == 256
    assert config["mooncake"]["shm_address"] == f"127.0.0.1:{port + 2}"
    assert config["mooncake"]["segment"] == f"127.0.0.1:{port + 3}"
    assert config["mooncake"]["master"] == f"127.0.0.1:{port + 4}"
    assert len(children_of(port)) == 3
    assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()
    proc.send_signal(stop_signal)
    assert proc.wait(30) == 0
    assert wait_until_gone(port, 1) == []


def test_cpus_binds_the_daemon_and_every_server_it_starts(tmp_path):
    proc, port = start_serve(tmp_path, "--cpus", "0")
    pids = [proc.pid, *children_of(port)]
    assert len(pids) == 4
    assert {pid: os.sched_getaffinity(pid) for pid in pids} == {pid: {0} for pid in pids}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a nice below 0 needs CAP_SYS_NICE")
def test_the_segment_owner_runs_before_the_daemons_other_servers(tmp_path):
    """It copies every DRAM hit into vLLM's pages on a core vLLM's engine core busy-polls
    (cachestore/host/cpu_priority.py)."""
    proc, port = start_serve(tmp_path)
    by_name = {Path(f"/proc/{pid}/comm").read_text().strip(): niceness(pid) for pid in children_of(port)}
    assert set(by_name) == {"redis-server", "mooncake_master", "mooncake_client"}
    assert set(by_name.pop("mooncake_client").values()) <= {-10, "-10", "none"}  # the default, PREFIXCACHE_OWNER_NICE
    assert all(set(seen.values()) <= {0, "0", "none"} for seen in by_name.values()), by_name
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_warmup_engines_run_on_the_cpus_the_daemon_had_before_binding(tmp_path):
    before = frozenset(os.sched_getaffinity(0))
    jobs = WarmupJobs(tmp_path, "http://127.0.0.1:1", tmp_path, engine_cpus=before)
    report = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    try:
        os.sched_setaffinity(0, {min(before)})  # as `serve --cpus` binds the daemon
        out = subprocess.run(report, capture_output=True, text=True, preexec_fn=jobs._child_setup).stdout
    finally:
        os.sched_setaffinity(0, before)
    assert out.strip() == str(sorted(before))


def test_the_embedded_stack_dies_with_a_killed_daemon(tmp_path):
    proc, port = start_serve(tmp_path)
    proc.kill()
    proc.wait()
    assert wait_until_gone(port) == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--port", "70000"], {}, "invalid setting port: Input should be less than or equal to 65535"),
        (["--chunk-tokens", "0"], {}, "invalid setting chunk_tokens"),
        (["--node", "bad node"], {}, "invalid setting node"),
        (["--redis-url", "http://user:pw@x"], {}, "must start with redis://"),
        ([], {"PREFIXCACHE_PORT": "abc"}, "invalid setting port"),
        (["--config", "/nonexistent.toml"], {}, "cannot read config file /nonexistent.toml"),
        (["--port", "notanumber"], {}, "Invalid value for '--port'"),
        (["--cpus", "1-0"], {}, "invalid setting cpus: '1-0' is not a CPU list"),
        ([], {"PREFIXCACHE_CPUS": "4095"}, "CPUs 4095 are not available to this process"),
        ([], {"PREFIXCACHE_OWNER_NICE": "-21"}, "invalid setting owner_nice: Input should be greater than or equal"),
        ([], {"PREFIXCACHE_WRITE_BEHIND_HOLD_S": "-1"}, "invalid setting write_behind_hold_s: Input should be greater"),
        (["--warmup-root", "relative/models"], {}, "warmup_roots: 'relative/models' is not an absolute"),
        ([], {"PREFIXCACHE_WARMUP_ROOTS": "/nonexistent"}, "warmup_roots: '/nonexistent' is not a folder"),
        (["--allowed-host", "evil/x"], {}, "invalid setting allowed_hosts: 'evil/x' is not a host name"),
        (["--max-body-bytes", "10"], {}, "invalid setting max_body_bytes: Input should be greater"),
    ],
)
def test_bad_settings_get_a_clear_error_and_exit_2(tmp_path, args, env, message):
    proc = run_cli("serve", "--data-dir", str(tmp_path), *args, env=env)
    assert proc.returncode == 2
    assert message in " ".join((proc.stderr + proc.stdout).split())
    assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [("port = [", "is not valid TOML"), ("unknown_key = 1", "invalid setting unknown_key: Extra inputs")],
)
def test_bad_config_files_are_rejected(tmp_path, content, message):
    path = tmp_path / "prefixcache.toml"
    path.write_text(content)
    proc = subprocess.run(
        [*CLI, "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 2 and message in " ".join(proc.stderr.split())


def test_unreachable_redis_url_fails_fast_with_exit_2(tmp_path):
    proc = run_cli("serve", "--data-dir", str(tmp_path), "--redis-url", f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "s3cret" not in proc.stderr


def _http_server(tmp_path: Path, port: int) -> ManagedProcess:
    return ManagedProcess(
        "http.server",
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        tmp_path / "http.log",
        lambda: port_open("127.0.0.1", port),
        listens_on=[("127.0.0.1", port)],
    )


def _listener(port: int) -> socket.socket:
    """A predecessor still holding the port (a server shutting down after its daemon was killed)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_server_waits_for_its_predecessor_to_release_its_port(tmp_path):
    port = free_port()
    holder = _listener(port)
    threading.Timer(1.0, holder.close).start()
    server = _http_server(tmp_path, port)
    started = time.monotonic()
    server.start(timeout_s=15)
    try:
        assert server.alive() and time.monotonic() - started >= 0.9
    finally:
        server.stop()


def test_a_port_that_stays_busy_is_a_clear_error(tmp_path):
    port = free_port()
    with _listener(port), pytest.raises(ServerStartError, match=f"127.0.0.1:{port} still in use"):
        _http_server(tmp_path, port).start(timeout_s=0.5)
