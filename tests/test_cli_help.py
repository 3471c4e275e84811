"""``prefixcache serve``, ``proxy`` and ``warmup --help`` in an 80-column terminal: every option on one line, its
name whole, with its one-line help and its default (the full descriptions are docs/settings.md's)."""

from __future__ import annotations

import re

import pytest
import typer.main
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from prefixcache.cachestore.cli.app import app
from prefixcache.cachestore.cli.option_help import short_help

COLUMNS = 80
DEFAULT = re.compile(r"\\?\[default: ([^\]]*)\]")


def _help_lines(command: str) -> list[str]:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": str(COLUMNS), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _ends_its_option(line: str) -> bool:
    """Whether ``line``, after an option's, leaves that option's text on one line: the next option, the panel's
    end, or typer's ``[required]`` mark."""
    return bool(re.match(r"│\s+(\*\s+)?-", line)) or line.startswith("╰") or line.strip("│ ") == "[required]"


@pytest.mark.parametrize("command", ["serve", "proxy", "warmup"])
def test_every_option_fits_one_line_with_its_default(command):
    lines = _help_lines(command)
    assert all(len(line) <= COLUMNS for line in lines)
    options = [p for p in typer.main.get_command(app).commands[command].params if p.param_type_name == "option"]
    assert len(options) >= 10
    for option in options:
        flag = max(option.opts, key=len)
        (at,) = [i for i, line in enumerate(lines) if re.match(rf"│\s+(\*\s+)?{re.escape(flag)}\s", line)]
        line = lines[at]
        assert "…" not in line and _ends_its_option(lines[at + 1]), f"{flag} takes more than a line:\n" + "\n".join(
            lines[at : at + 3]
        )
        assert option.help and option.help.split(" \\[")[0] in line, f"{flag}'s help is not on its line: {line}"
        default = DEFAULT.search(option.help)
        if default:
            assert f"[default: {default.group(1)}]" in line, f"{flag}'s default is not on its line: {line}"


def test_serve_groups_its_options_in_panels():
    panels = [re.match(r"╭─ (.+?) ─", line).group(1) for line in _help_lines("serve") if line.startswith("╭─")]
    assert {"Node", "Index", "Mooncake", "Tiers", "Security", "Warm-up jobs"} <= set(panels)


def test_a_setting_without_a_one_line_help_is_named():
    class Unhelped(BaseModel):
        knob: int = Field(default=1, description="A knob. It turns.")

    with pytest.raises(ValueError, match=r"Unhelped\.knob has no one-line help"):
        short_help(Unhelped, "knob")
