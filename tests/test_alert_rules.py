"""The alert rules (deploy/prometheus/prefixcache-rules.yaml) as Prometheus's own ``promtool`` reads them: valid,
each alert proven by the unit tests of prefixcache-rules.test.yaml, and each one explained in docs/operations.md's
alerts table, which its ``runbook`` annotation links."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_docs import _anchors

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "prefixcache-rules.yaml"
RULE_TESTS = RULES.with_name("prefixcache-rules.test.yaml")
OPERATIONS = ROOT / "docs" / "operations.md"

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (deploy/setup.sh installs Debian's prometheus)"
)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules():
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr


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
