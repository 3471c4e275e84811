"""deploy/ holds files a user applies as they are: each is checked by its tool's own validator, and every
setting they name must be one ``prefixcache serve`` knows (the daemon refuses unknown settings in flags and
files, but an unknown ``PREFIXCACHE_*`` variable is simply not read, so a typo would go unnoticed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefixcache.cachestore.node.settings import Settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DEPLOY_TEXT_FILES = [COMPOSE, *MANIFESTS, *UNITS, *(DEPLOY / "systemd").glob("*.env"), DEPLOY / "GUIDE.md"]
BIN = Path(sys.executable).parent


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


#: Variables of other commands than ``serve``: the proxy's token and the index password of the proxy and warm-up.
OTHER_COMMANDS_VARIABLES = {"PREFIXCACHE_PROXY_TOKEN", "PREFIXCACHE_REDIS_PASSWORD"}


def test_every_prefixcache_variable_named_in_deploy_is_a_setting():
    known = {f"PREFIXCACHE_{name.upper()}" for name in Settings.model_fields} | OTHER_COMMANDS_VARIABLES
    for path in DEPLOY_TEXT_FILES:
        named = set(re.findall(r"\bPREFIXCACHE_[A-Z_]+[A-Z]\b", path.read_text()))
        assert named <= known, f"{path.name} names unknown settings {sorted(named - known)}"


def test_every_setting_is_documented_in_the_guide():
    guide = (DEPLOY / "GUIDE.md").read_text()
    missing = [name for name in Settings.model_fields if f"PREFIXCACHE_{name.upper()}" not in guide]
    assert not missing, f"deploy/GUIDE.md does not document {missing}"


def test_the_compose_file_matches_the_compose_specification():
    result = _run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_docker_compose_accepts_the_compose_file():
    if shutil.which("docker") and _run(["docker", "compose", "version"]).returncode == 0:
        argv = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        argv = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    result = _run([*argv, "-f", str(COMPOSE), "config", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_match_the_api_schemas():
    result = _run([str(BIN / "kubernetes-validate"), "--strict", *map(str, MANIFESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {doc["kind"] for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc}
    assert {"DaemonSet", "StatefulSet", "Deployment", "Service", "ConfigMap"} <= kinds


def test_the_daemonset_shares_the_hosts_network_and_ipc_and_mounts_its_nvme_path():
    documents = yaml.safe_load_all((DEPLOY / "k8s" / "daemon.yaml").read_text())
    (daemonset,) = [d for d in documents if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] and pod["hostIPC"]  # shared-memory attach of the node's vLLM workers
    (container,) = pod["containers"]
    assert {"name": "nvme", "mountPath": "/nvme"} in container["volumeMounts"]
    assert any(v["name"] == "nvme" and "hostPath" in v for v in pod["volumes"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_parse(unit, tmp_path):
    """``systemd-analyze verify`` on the unit; only complaints about this machine (no /opt/prefixcache, units that
    are installed elsewhere) are accepted, never a syntax or directive error."""
    target = tmp_path / unit.name.replace("@.", "@example.")
    target.write_text(unit.read_text())
    result = _run(["systemd-analyze", "verify", "--man=no", str(target)])
    environmental = ("is not executable", "not found", "Failed to create", "Failed to prepare filename")
    problems = [line for line in result.stderr.splitlines() if line and not any(e in line for e in environmental)]
    assert not problems, "\n".join(problems)
