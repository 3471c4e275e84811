"""``prefixcache stats | ls | lookup | evict | pin | unpin`` against a real daemon, as a user runs them."""

# ruff: noqa: F811 - the shared fixtures are imported by name
from __future__ import annotations

import json
import subprocess

from tests.admin_stack import TOKEN, api, client, daemon  # noqa: F401 - fixtures
from tests.daemon_harness import publish_prompt, run_cli


def cli(daemon, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    return run_cli(daemon, *args, token=token)


def test_inspect_pin_and_evict_from_the_command_line(daemon, client, api):
    keys, _ = publish_prompt(client, list(range(64 * 3)))
    ns = client.spec.digest.hex()
    listing = json.loads(cli(daemon, "ls", "--json").stdout)
    assert sorted(c["key"] for c in listing["chunks"]) == sorted(k.hex() for k in keys)
    table = cli(daemon, "ls", "--limit", "2")
    assert table.returncode == 0 and "more: --cursor" in table.stdout
    found = cli(daemon, "lookup", "--namespace", ns, "--tokens", ",".join(map(str, range(100))))
    assert "100 of 100 tokens cached in 2 chunks" in found.stdout
    assert "pinned 3 chunks" in cli(daemon, "pin", "--namespace", ns, "--tokens", ",".join(map(str, range(192)))).stdout
    assert "evicted 0 chunks" in cli(daemon, "evict", "--all").stdout
    assert "would evict 3 chunks" in cli(daemon, "evict", "--all", "--force", "--dry-run").stdout
    assert "unpinned 1 chunks" in cli(daemon, "unpin", keys[0].hex()).stdout
    stats = cli(daemon, "stats")
    assert stats.returncode == 0 and "test-model" in stats.stdout and "nvme" in stats.stdout
    assert json.loads(cli(daemon, "stats", "--json").stdout)["namespaces"][ns]["chunks"] == 3
    assert "evicted 3 chunks" in cli(daemon, "evict", "--model", "test-model", "--force").stdout


def test_refusals_and_mistakes_are_one_clear_line_and_exit_2(daemon):
    refused = cli(daemon, "stats", token=None)
    assert refused.returncode == 2 and "401" in refused.stderr and "admin token" in refused.stderr
    assert TOKEN not in refused.stderr
    bad = cli(daemon, "evict", "not-a-key")
    assert bad.returncode == 2 and "keys.0" in bad.stderr
    assert cli(daemon, "evict").returncode == 2
    assert "--tokens takes integers" in cli(daemon, "lookup", "--namespace", "0" * 32, "--tokens", "1,x").stderr
    unreachable = cli(daemon, "stats", "--url", "http://127.0.0.1:1")
    assert unreachable.returncode == 2 and "cannot reach the daemon" in unreachable.stderr
