"""The alert rules (deploy/prometheus/prefixcache-rules.yaml) as Prometheus's own ``promtool`` reads them: valid,
each alert proven by the unit tests of prefixcache-rules.test.yaml, and each one explained in docs/operations.md's
alerts table, which its ``runbook`` annotation links; and loaded in a real Prometheus scraping a real daemon whose
index freezes: the index alert, not the node-down one, goes pending."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.daemon_harness import Daemon, servers_of, wait_for
from tests.netns import freeze_processes
from tests.prometheus_server import ScrapeJob, prometheus
from tests.test_docs import _anchors

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "prefixcache-rules.yaml"
RULE_TESTS = RULES.with_name("prefixcache-rules.test.yaml")
OPERATIONS = ROOT / "docs" / "operations.md"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (deploy/setup.sh installs Debian's prometheus)"
)
TOKEN = "alert-rules-test-admin-token"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@needs_promtool
def test_promtool_checks_the_rules():
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    tested = _promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    covered = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    untested = {rule["alert"] for rule in _alerts()} - covered
    assert not untested, f"alerts without a unit test in {RULE_TESTS.name}: {sorted(untested)}"


def test_every_alert_says_what_to_do_and_links_its_explanation():
    section = OPERATIONS.read_text().split("### Alerts", 1)[1].split("\n#", 1)[0]
    explained = set(re.findall(r"^\| `(\w+)`", section, re.M))
    for rule in _alerts():
        annotations = rule["annotations"]
        assert len(annotations["summary"]) > 40, rule["alert"]
        path, _, anchor = annotations["runbook"].partition("#")
        assert ROOT / path == OPERATIONS and anchor in _anchors(OPERATIONS), annotations["runbook"]
    assert explained == {rule["alert"] for rule in _alerts()}, "docs/operations.md's alerts table and the rules differ"


def test_a_frozen_index_makes_its_alert_pend_within_a_scrape(tmp_path):
    """With the index's redis-server stopped (SIGSTOP: it neither answers nor refuses), the daemon still answers
    ``/metrics`` within a 10-second scrape, saying which component is down."""
    daemon = Daemon(tmp_path / "data", "--admin-token", TOKEN).start()
    redis_server = servers_of(daemon)["redis-server"]
    try:
        job = ScrapeJob("prefixcache", [f"127.0.0.1:{daemon.port}"], TOKEN, interval_s=10)
        with prometheus(tmp_path / "prometheus", [job], rule_files=[RULES]) as server:
            assert wait_for(lambda: server.has_numbers('up{job="prefixcache"} == 1'), timeout_s=30)
            assert not server.alerts()
            freeze_processes([redis_server])
            try:
                pending = lambda: {a["labels"]["alertname"] for a in server.alerts()}  # noqa: E731
                assert wait_for(lambda: "PrefixcacheIndexUnreachable" in pending(), timeout_s=40)
                assert server.has_numbers('up{job="prefixcache"} == 1'), "the scrape failed: the node looks down"
                assert "PrefixcacheNodeDown" not in pending()  # NodeDegraded may pend: nothing persists meanwhile
            finally:
                os.kill(redis_server, signal.SIGCONT)
    finally:
        daemon.stop()
