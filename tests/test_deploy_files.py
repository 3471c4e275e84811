"""deploy/ holds files a user applies as they are: each is checked by its tool's own validator, and every
setting they name must be one ``prefixcache serve`` knows (the daemon refuses unknown settings in flags and
files, but an unknown ``PREFIXCACHE_*`` variable is simply not read, so a typo would go unnoticed)."""

from __future__ import annotations

import json
import os
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
#: An override of ``COMPOSE``: the index as a Redis Cluster.
CLUSTER_COMPOSE = DEPLOY / "docker-compose.redis-cluster.yml"
#: An override of ``COMPOSE``: Mooncake masters in high-availability mode over etcd.
HA_COMPOSE = DEPLOY / "docker-compose.mooncake-ha.yml"
MANIFESTS = sorted((DEPLOY / "k8s").rglob("*.yaml"))
CLUSTER_MANIFEST = DEPLOY / "k8s" / "redis-cluster" / "redis-cluster.yaml"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DEPLOY_TEXT_FILES = [
    COMPOSE,
    CLUSTER_COMPOSE,
    HA_COMPOSE,
    *MANIFESTS,
    *UNITS,
    *(DEPLOY / "systemd").glob("*.env"),
    DEPLOY / "GUIDE.md",
]
#: The index's Redis Cluster in both: masters, each with one replica.
CLUSTER_MASTERS, CLUSTER_NODES = 3, 6
BIN = Path(sys.executable).parent


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``argv``'s outcome; ``env``: variables to add to this process's."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


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


@pytest.mark.parametrize("compose", [COMPOSE, CLUSTER_COMPOSE, HA_COMPOSE], ids=lambda p: p.name)
def test_the_compose_files_match_the_compose_specification(compose):
    result = _run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(compose)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, CLUSTER_COMPOSE], [COMPOSE, HA_COMPOSE]],
    ids=["standalone", "redis-cluster", "mooncake-ha"],
)
def test_docker_compose_accepts_the_compose_files(files):
    if shutil.which("docker") and _run(["docker", "compose", "version"]).returncode == 0:
        argv = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        argv = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    options = [option for path in files for option in ("-f", str(path))]
    result = _run([*argv, *options, "config", "--quiet"], env={"REDIS_PASSWORD": "x" * 32})
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_match_the_api_schemas():
    result = _run([str(BIN / "kubernetes-validate"), "--strict", *map(str, MANIFESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {doc["kind"] for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc}
    assert {"DaemonSet", "StatefulSet", "Deployment", "Service", "ConfigMap", "Job"} <= kinds


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


def _cluster_create_nodes(script: str) -> list[str]:
    """The ``host:port`` of every node the ``redis-cli --cluster create`` in ``script`` forms the cluster of, and
    checks that it gives each master one replica."""
    match = re.search(r"redis-cli --cluster create (.+?) --cluster-replicas (\d+) --cluster-yes", script)
    assert match, f"no redis-cli --cluster create ... --cluster-yes in {script!r}"
    assert int(match.group(2)) == CLUSTER_NODES // CLUSTER_MASTERS - 1
    return match.group(1).split()


def _redis_node_options(script: str) -> dict[str, str]:
    """The ``--name value`` options of the ``redis-server`` a node's start script runs."""
    server = script.split("exec redis-server", 1)[1]
    return dict(re.findall(r"--([a-z-]+) (\S+)", server))


def test_the_cluster_compose_file_forms_a_cluster_of_its_nodes_and_points_the_stack_at_it():
    services = yaml.safe_load(CLUSTER_COMPOSE.read_text())["services"]
    nodes = {name: s for name, s in services.items() if "cluster-enabled yes" in " ".join(s.get("command", []))}
    assert len(nodes) == CLUSTER_NODES
    ports = set()
    for name, node in nodes.items():
        options = _redis_node_options(node["command"][-1])
        assert options["appendonly"] == "yes" and options["appendfsync"] == "everysec", name
        assert "requirepass" in node["command"][-1] and node["secrets"] == ["redis-password"], name
        assert options["port"] == '"$$REDIS_PORT"'
        ports.add(f"127.0.0.1:{node['environment']['REDIS_PORT']}")
    assert len(ports) == CLUSTER_NODES
    create = services["redis-cluster-create"]
    assert set(_cluster_create_nodes(create["command"][-1])) == ports
    assert set(create["depends_on"]) == set(nodes)
    daemon = services["prefixcache"]
    url = daemon["environment"]["PREFIXCACHE_REDIS_URL"]
    assert re.fullmatch(r"redis\+cluster://:\$\{REDIS_PASSWORD[^}]*\}@(127\.0\.0\.1:\d+)", url).group(1) in ports
    assert daemon["depends_on"]["redis-cluster-create"] == {"condition": "service_completed_successfully"}
    for vllm in ("vllm-prefill", "vllm-decode"):
        (transfer,) = [arg for arg in services[vllm]["command"] if arg.startswith("--kv-transfer-config=")]
        extra = json.loads(transfer.split("=", 1)[1])["kv_connector_extra_config"]
        assert extra["redis_password"] == "${REDIS_PASSWORD}", vllm
    assert services["proxy"]["environment"]["PREFIXCACHE_REDIS_PASSWORD"] == "${REDIS_PASSWORD}"


def test_the_cluster_manifest_runs_six_nodes_on_the_index_secret_and_forms_them_into_a_cluster():
    documents = {d["kind"]: d for d in yaml.safe_load_all(CLUSTER_MANIFEST.read_text()) if d["kind"] != "Service"}
    statefulset, job = documents["StatefulSet"], documents["Job"]
    assert statefulset["spec"]["replicas"] == CLUSTER_NODES
    (node,) = statefulset["spec"]["template"]["spec"]["containers"]
    options = _redis_node_options(node["command"][-1])
    assert options["cluster-enabled"] == "yes" and options["appendonly"] == "yes"
    assert options["appendfsync"] == "everysec"
    index_password = {"secretKeyRef": {"name": "prefixcache-index", "key": "password"}}
    assert {"name": "REDISCLI_AUTH", "valueFrom": index_password} in node["env"]
    (create,) = job["spec"]["template"]["spec"]["containers"]
    assert {"name": "REDISCLI_AUTH", "valueFrom": index_password} in create["env"]
    script = create["command"][-1]
    assert _cluster_create_nodes(script) == ["$nodes"]
    pods = re.search(r"for i in ([\d ]+); do", script).group(1).split()
    assert pods == [str(i) for i in range(CLUSTER_NODES)]
    assert f"{statefulset['metadata']['name']}-$i.{statefulset['spec']['serviceName']}" in script


def test_the_daemons_and_the_proxy_take_the_index_secret_where_there_is_one():
    """The URL and password in the Secret the cluster manifest has made (optional: redis.yaml runs without)."""
    index_url = {"secretKeyRef": {"name": "prefixcache-index", "key": "redis-url", "optional": True}}
    index_password = {"secretKeyRef": {"name": "prefixcache-index", "key": "password", "optional": True}}
    for path, variable, source in [
        ("daemon.yaml", "PREFIXCACHE_REDIS_URL", index_url),
        ("proxy.yaml", "PREFIXCACHE_REDIS_PASSWORD", index_password),
    ]:
        documents = yaml.safe_load_all((DEPLOY / "k8s" / path).read_text())
        (workload,) = [d for d in documents if d["kind"] in ("DaemonSet", "Deployment")]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        assert {"name": variable, "valueFrom": source} in container["env"], path
    assert "redis-url=redis+cluster://:$PASSWORD@prefixcache-redis-cluster:6379" in CLUSTER_MANIFEST.read_text()
