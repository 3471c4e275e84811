"""One daemon per data dir, and a data dir that cannot be one: refused at once, in one line, changing nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.host.processes import free_port_block
from prefixcache.cachestore.node.data_dir_lock import DataDirLock
from prefixcache.indexer.errors import ConfigError
from tests.daemon_harness import fetch_payloads, make_spec, publish_prompt, servers_of, wait_persisted


def serve(data_dir: Path, port: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``prefixcache serve`` to completion (it should refuse at once), with a wide terminal and ``env`` added."""
    argv = [
        sys.executable,
        "-m",
        "prefixcache.cachestore",
        "serve",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--dram-bytes",
        "128MiB",
        "--nvme-bytes",
        "512MiB",
        *extra,
    ]
    environment = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=environment)


def test_a_second_lock_of_a_data_dir_names_the_holder_and_succeeds_once_it_is_released(tmp_path):
    first, second = DataDirLock(tmp_path / "data"), DataDirLock(tmp_path / "data")
    first.acquire(8600)
    with pytest.raises(ConfigError, match=rf"in use by another prefixcache daemon \(pid {os.getpid()}, port 8600\)"):
        second.acquire(8700)
    first.release()
    second.acquire(8700)
    assert '"port": 8700' in (tmp_path / "data" / "daemon.lock").read_text()
    second.release()


def test_a_second_daemon_on_the_same_data_dir_is_refused_and_the_first_keeps_serving(daemon):
    servers = servers_of(daemon)
    refused = serve(daemon.data_dir, free_port_block(7))
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert f"is in use by another prefixcache daemon (pid {daemon.proc.pid}, port {daemon.port})" in message
    assert "Traceback" not in refused.stderr
    assert servers_of(daemon) == servers  # it started nothing (its own redis-server would share our AOF)
    client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20)
    try:
        keys, payloads = publish_prompt(client, list(range(64 * 3)))
        wait_persisted(client, keys)
        assert fetch_payloads(client, keys) == payloads
    finally:
        client.close()
    assert httpx.get(daemon.url + "/v1/health").status_code == 200


def test_a_second_daemon_given_the_first_ones_nvme_dir_is_refused_and_the_manifest_stays(daemon, tmp_path):
    """Another data dir but the first daemon's NVMe tier: refused, naming the holder, before it opens the tier
    (RocksDB's manifest, whose own lock the first holds, would be taken for broken and moved aside)."""
    nvme = daemon.data_dir / "nvme"
    before = sorted(path.name for path in nvme.iterdir())
    refused = serve(tmp_path / "other", free_port_block(7), "--nvme-dir", str(nvme))
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert f"NVMe tier dir {nvme} is in use by another prefixcache daemon (pid {daemon.proc.pid}" in message
    assert "--nvme-dir" in message and "Traceback" not in refused.stderr
    assert sorted(path.name for path in nvme.iterdir()) == before  # no manifest moved aside
    assert httpx.get(daemon.url + "/v1/health").status_code == 200


AS_ROOT_WRITES_ANYWHERE = pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")


def a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("")
    return tmp / "file"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (a_file, "is not a directory"),
        (lambda tmp: a_file(tmp) / "data", "Not a directory"),
        pytest.param(lambda tmp: tmp / "ro" / "data", "Permission denied", marks=AS_ROOT_WRITES_ANYWHERE),
    ],
    ids=["a-file", "under-a-file", "unwritable"],
)
def test_a_data_dir_that_cannot_be_one_is_a_one_line_error(tmp_path, make, message):
    (tmp_path / "ro").mkdir(mode=0o500)
    data_dir = make(tmp_path)
    refused = serve(data_dir, free_port_block(7))
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{data_dir}" in errors[0] and message in errors[0], refused.stderr
    assert "Traceback" not in refused.stderr
