"""Without an extra's Mooncake (the core install has none), a node and the connector fail with one line naming the
extra to install (cachestore/tiers/mooncake_import.py). Each case runs in a fresh interpreter where importing
``mooncake`` fails, as where it is not installed. Without the ``object`` extra (the S3 client and the cipher of the
object tier), which the core install lacks too, they load as long as no bucket is set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ADVICE = "install prefixcache[cpu] on a CPU host or prefixcache[cuda] on an NVIDIA host"
#: Runs ``python -c BLOCKED CODE...``: ``mooncake`` cannot be imported, then CODE runs.
BLOCKED = "import sys; sys.modules['mooncake'] = None; exec(sys.argv[1])"


def without_mooncake(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300"}  # the CLI's line unwrapped, as a wide terminal shows it
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def cli(*args: str) -> str:
    return f"import runpy; sys.argv = ['prefixcache', *{list(args)!r}]; runpy.run_module('prefixcache.cachestore')"


def test_serve_says_which_extra_to_install_in_one_line_and_exits_2(tmp_path: Path) -> None:
    result = without_mooncake(cli("serve", "--data-dir", str(tmp_path / "data")), tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: the DRAM tier needs Mooncake, which cannot be imported (") and line.endswith(ADVICE)
    assert not (tmp_path / "data").exists()  # it failed before touching anything


def test_the_cli_needs_no_extra_to_list_its_commands(tmp_path: Path) -> None:
    result = without_mooncake(cli("--help"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_the_connector_fails_with_the_same_advice_and_no_mooncake_traceback(tmp_path: Path) -> None:
    """The worker side, which vLLM's connector builds in each worker, imports the DRAM tier at once."""
    result = without_mooncake("import prefixcache.connector.worker_side", tmp_path)
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]
    assert last.startswith("prefixcache.cachestore.tiers.mooncake_import.MissingExtraError: ") and last.endswith(ADVICE)
    assert "During handling" not in result.stderr  # the failed import of mooncake is not chained to it


#: Runs ``python -c WITHOUT_OBJECT CODE...``: the object extra's S3 client and cipher cannot be imported.
WITHOUT_OBJECT = "import sys; sys.modules['obstore'] = sys.modules['cryptography'] = None; exec(sys.argv[1])"


def test_the_s3_client_and_the_cipher_come_only_with_the_object_extra() -> None:
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    for requirement in map(Requirement, requires("prefixcache") or []):
        if requirement.name in ("obstore", "cryptography"):
            assert requirement.marker is not None, requirement
            assert not requirement.marker.evaluate({"extra": ""}), f"{requirement} is installed without an extra"


def test_a_node_and_the_connector_load_without_the_object_extra(tmp_path: Path) -> None:
    """Without a bucket set nothing imports them: the daemon, its CLI and both sides of the connector load."""
    code = (
        "import prefixcache.cachestore.node.daemon, prefixcache.cachestore.cli.app, "
        "prefixcache.connector.scheduler_side, prefixcache.connector.worker_side"
    )
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_OBJECT, code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
