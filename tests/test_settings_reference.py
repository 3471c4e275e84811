"""docs/settings.md and ``prefixcache serve --help`` say what the settings' own descriptions say, and nothing is
left undescribed (devtools/settings_reference.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from devtools import settings_reference
from prefixcache.cachestore.cli import option_help
from prefixcache.cachestore.cli.app import app
from prefixcache.cachestore.node.settings import Settings
from prefixcache.connector.settings import ConnectorSettings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "settings.md"
GENERATOR = [sys.executable, "-m", "devtools.settings_reference"]


def test_the_page_is_what_the_generator_writes():
    assert PAGE.read_text() == settings_reference.render(), "docs/settings.md is out of date: run make docs"


def test_check_passes_on_the_page_and_names_what_differs(tmp_path):
    assert subprocess.run([*GENERATOR, "--check"], capture_output=True, text=True, cwd=ROOT).returncode == 0
    stale = tmp_path / "settings.md"
    stale.write_text(PAGE.read_text().replace("`PREFIXCACHE_KEY_PREFIX` |", "`PREFIXCACHE_KEY_PREFIXES` |"))
    proc = subprocess.run([*GENERATOR, "--check", str(stale)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert str(stale) in proc.stderr and "key_prefix" in proc.stderr
    assert stale.read_text() != settings_reference.render()  # --check writes nothing
    missing = subprocess.run(
        [*GENERATOR, "--check", str(tmp_path / "none.md")], capture_output=True, text=True, cwd=ROOT
    )
    assert missing.returncode == 1


def test_the_generator_writes_the_page_without_a_web_framework(tmp_path):
    script = (
        "import sys; from devtools.settings_reference import main; "
        f"main([{str(tmp_path / 'settings.md')!r}]); "
        "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.strip() == "[]"
    assert (tmp_path / "settings.md").read_text() == PAGE.read_text()


@pytest.mark.parametrize("model", [Settings, ConnectorSettings], ids=["daemon", "connector"])
def test_every_setting_has_a_description(model):
    undescribed = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not undescribed, f"{model.__name__}: add Field(description=...) to {undescribed}"


def test_every_daemon_setting_is_on_the_page_in_one_group():
    settings_reference.check_groups()
    page = PAGE.read_text()
    for name in Settings.model_fields:
        assert f"| `{name}` | `PREFIXCACHE_{name.upper()}` |" in page
    for name in ConnectorSettings.model_fields:
        assert f"| `{name}` |" in page


def test_every_serve_flag_sets_the_setting_it_is_listed_under(monkeypatch):
    """Each option of ``serve`` (but --config) reaches load_settings under the name of the setting the page lists
    it with, and takes its help from that setting's description."""
    from prefixcache.cachestore.node import daemon, settings

    options = settings_reference.serve_options()
    assert options, "serve has no options"
    args = []
    for setting, option in options.items():
        assert option.help == option_help.field_help(setting, repeated=option.multiple), option.opts[0]
        if option.is_flag:
            args.append(option.opts[0])
        else:
            args += [option.opts[0], "7"]  # a string, a number and a relative path alike
    seen = {}

    def capture(flags, config):
        seen.update(flags)
        raise SystemExit(0)

    monkeypatch.setattr(settings, "load_settings", capture)
    monkeypatch.setattr(daemon, "NodeDaemon", lambda loaded: None)
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert set(seen) <= set(Settings.model_fields), set(seen) - set(Settings.model_fields)
    unset = [f"{options[name].opts[0]} -> {name}" for name in options if seen.get(name) in (None, [], False)]
    assert not unset, f"these flags did not set the setting they are listed under: {unset}"


def test_serve_help_points_at_the_page():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "All settings: docs/settings.md" in result.output
    assert "REST API address [default: 127.0.0.1]" in result.output  # Settings.host's short help and default


def test_the_index_password_comes_from_the_environment_only(monkeypatch):
    """The one reading of ``PREFIXCACHE_REDIS_PASSWORD`` (daemon, ``warmup`` and ``proxy`` alike)."""
    from prefixcache.cachestore.node.settings import redis_password_from_environment

    monkeypatch.setenv("PREFIXCACHE_REDIS_PASSWORD", "s3cret")
    assert redis_password_from_environment() == "s3cret"
    monkeypatch.setenv("PREFIXCACHE_REDIS_PASSWORD", "")
    assert redis_password_from_environment() is None
    monkeypatch.delenv("PREFIXCACHE_REDIS_PASSWORD")
    assert redis_password_from_environment() is None
