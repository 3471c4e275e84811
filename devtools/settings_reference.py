"""docs/settings.md, rendered from the settings themselves: each setting is described once, in its ``Field``.

A development script, not part of the package: ``python -m devtools.settings_reference`` (``make docs``) writes the
page; with ``--check`` it writes nothing and exits 1 when the page differs from what it would write
(tests/test_settings_reference.py runs it so). The daemon's settings (``Settings``) come in groups (``GROUPS``),
each setting with its variable, the ``prefixcache serve`` flag that sets it (read off the command itself), its
config-file key, type, default and description; the connector's (``ConnectorSettings``, vLLM's
``kv_connector_extra_config``) in one table. The options' one-line help and the defaults as text are the
package's own (``prefixcache.cachestore.cli.option_help``), so the page and ``--help`` cannot disagree.

The page is a pure function of the settings classes and the command, and rendering it imports no web framework.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel, ByteSize, SecretStr
from pydantic.fields import FieldInfo

from prefixcache.cachestore.cli.app import app
from prefixcache.cachestore.cli.option_help import default_text, size_text
from prefixcache.cachestore.node.settings import Settings
from prefixcache.cachestore.proxy.settings import AUTH_TOKEN_ENV, REDIS_PASSWORD_ENV, ProxySettings
from prefixcache.connector.settings import ConnectorSettings

#: The page, relative to the repository's root (this file is devtools/settings_reference.py in it).
DOCS_PAGE = Path("docs") / "settings.md"
REPOSITORY = Path(__file__).resolve().parents[1]

#: The daemon's settings by topic, in the page's order. Every setting is in exactly one group (``check_groups``).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("The node and its REST API", ("node", "host", "port", "data_dir")),
    ("The index", ("redis_url", "redis_port", "key_prefix", "chunk_tokens")),
    (
        "The tiers: DRAM and NVMe",
        (
            "dram_bytes",
            "nvme_bytes",
            "nvme_dir",
            "dram_high_watermark",
            "dram_low_watermark",
            "write_behind_hold_s",
        ),
    ),
    (
        "The object tier: a shared S3 bucket",
        (
            "object_store_url",
            "object_store_endpoint",
            "object_store_region",
            "object_store_path_style",
            "object_store_bytes",
            "object_store_max_age_s",
        ),
    ),
    (
        "The Mooncake pool",
        (
            "mooncake_master",
            "mooncake_metadata_url",
            "mooncake_metrics_url",
            "mooncake_host",
            "mooncake_protocol",
            "mooncake_device_names",
            "shm_port",
            "segment_port",
            "master_port",
        ),
    ),
    ("Security", ("chunk_key_file", "admin_token", "open_reads", "allowed_hosts", "max_body_bytes")),
    (
        "Quotas",
        ("tenant_quotas", "default_tenant_quota", "namespace_quotas", "quota_low_watermark", "quota_scan_entries"),
    ),
    ("Warm-up jobs", ("warmup_roots", "warmup_allow_trust_remote_code")),
    ("KV events", ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic")),
    ("CPUs", ("cpus", "owner_nice")),
)


def check_groups() -> None:
    """Raise unless ``GROUPS`` names every daemon setting exactly once."""
    grouped = [name for _, names in GROUPS for name in names]
    missing = [name for name in Settings.model_fields if name not in grouped]
    unknown = [name for name in grouped if name not in Settings.model_fields]
    twice = sorted({name for name in grouped if grouped.count(name) > 1})
    if missing or unknown or twice:
        raise ValueError(
            f"settings_reference.GROUPS must name every setting once: missing {missing}, unknown {unknown}, "
            f"twice {twice}"
        )


def description(model: type[BaseModel], name: str) -> str:
    """The one description of setting ``name`` of ``model`` (Markdown: code in backticks)."""
    text = model.model_fields[name].description
    if not text or not text.strip():
        raise ValueError(f"{model.__name__}.{name} has no description")
    return " ".join(text.split())


def type_text(annotation: Any, metadata: Iterable[Any] = ()) -> str:
    """A reader's name for a setting's type, with the bounds its ``Field`` puts on it."""
    metadata = list(metadata)
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        field_metadata = [m for item in extra for m in (item.metadata if isinstance(item, FieldInfo) else [item])]
        return type_text(inner, [*metadata, *field_metadata])
    if origin in (Union, types.UnionType):
        options = [arg for arg in get_args(annotation) if arg is not type(None)]
        values = [f"`{value}`" for arg in options if get_origin(arg) is Literal for value in get_args(arg)]
        return _either(values + [type_text(arg, metadata) for arg in options if get_origin(arg) is not Literal])
    if origin is Literal:
        return _either([f"`{value}`" for value in get_args(annotation)])
    if origin is list:
        (item,) = get_args(annotation)
        head, _, rest = type_text(item).partition(" (")
        items = {"string": "strings", "path": "paths", "integer": "integers"}.get(head, head) + (
            f" ({rest}" if rest else ""
        )
        non_empty = any(isinstance(m, MinLen) and m.min_length == 1 for m in metadata)
        return ("non-empty list of " if non_empty else "list of ") + items
    if isinstance(annotation, type) and issubclass(annotation, ByteSize):
        return "size: bytes, or with a unit (`4GiB`, `512MB`)" + _bounds(metadata, shown=size_text)
    name = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        Path: "path",
        SecretStr: "string (secret)",
    }.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return name + _bounds(metadata, unit=" characters" if annotation is str else "", integer=annotation is int)


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _bounds(metadata: Iterable[Any], *, unit: str = "", integer: bool = False, shown: Any = str) -> str:
    """`` (1 to 65535)``, `` (> 0, < 1)``, `` (1 to 128 characters, `^...$`)``: what the metadata allows."""
    low: str | None = None
    high: str | None = None
    patterns = []
    for item in metadata:
        if isinstance(item, Ge):
            low = shown(item.ge)
        elif isinstance(item, Gt):
            low = shown(item.gt + 1) if integer else f"> {shown(item.gt)}"
        elif isinstance(item, Le):
            high = shown(item.le)
        elif isinstance(item, Lt):
            high = shown(item.lt - 1) if integer else f"< {shown(item.lt)}"
        elif isinstance(item, MinLen):
            low = str(item.min_length)
        elif isinstance(item, MaxLen):
            high = str(item.max_length)
        elif getattr(item, "pattern", None):
            patterns.append(f"`{item.pattern}`")
    exclusive = (low or "").startswith(">") or (high or "").startswith("<")
    if low is not None and high is not None and not exclusive:
        parts = [f"{low} to {high}{unit}"]
    else:
        parts = [low if low.startswith(">") else f"at least {low}{unit}"] if low is not None else []
        parts += [high if high.startswith("<") else f"at most {high}{unit}"] if high is not None else []
    parts += patterns
    return f" ({', '.join(parts)})" if parts else ""


# The flags of `prefixcache serve`.


def command_params(command: str) -> list[Any]:
    """The parameters (click's) of ``prefixcache COMMAND``."""
    return typer.main.get_command(app).commands[command].params


def serve_options() -> dict[str, Any]:
    """``prefixcache serve``'s options by the daemon setting each sets (click's ``Option``; ``--config`` left out).

    An option is named as its setting, or, taking one value at a time (``--allowed-host`` again and again), as its
    list setting without the plural ``s``. Raises for an option that sets no setting."""
    options = {}
    for param in command_params("serve"):
        if param.param_type_name != "option" or param.name in ("config", "help"):
            continue
        setting = param.name if param.name in Settings.model_fields else f"{param.name}s"
        if setting not in Settings.model_fields or (setting != param.name and not param.multiple):
            raise ValueError(f"prefixcache serve's option {param.opts[0]} sets no daemon setting")
        options[setting] = param
    return options


def flag_text(option: Any) -> str:
    flag = f"`{option.opts[0]}`"
    return f"{flag} (repeat)" if option.multiple else flag


# The page.


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> Iterator[str]:
    header = list(header)
    yield "| " + " | ".join(header) + " |"
    yield "|" + "---|" * len(header)
    for row in rows:
        yield "| " + " | ".join(_cell(cell) for cell in row) + " |"


def daemon_section() -> Iterator[str]:
    check_groups()
    prefix = Settings.model_config["env_prefix"]
    flags = serve_options()
    yield "## The daemon: `prefixcache serve`"
    yield ""
    yield "Each setting is read from, lowest precedence first:"
    yield ""
    yield "1. its default;"
    yield (
        "2. the config file, `prefixcache serve --config FILE`: TOML, or JSON when its name ends in `.json`, with "
        "the settings' names as keys;"
    )
    yield f"3. the environment: `{prefix}` and the setting's name in upper case;"
    yield "4. `prefixcache serve`'s flags, where a setting has one."
    yield ""
    yield (
        "So defaults < config file < environment < flags. Anything invalid stops the daemon before it starts "
        "anything, naming the setting, the reason and where values come from; no secret is echoed. An unknown "
        "key in the file is an error, and so is an unknown flag; an unknown variable is not read, so check its "
        "spelling. Sizes take bytes or a unit (`4GiB`, `512MB`); booleans take `true` or `false` (also `1` or "
        "`0` in the environment). A config file:"
    )
    yield ""
    yield "```toml"
    yield 'data_dir = "/var/lib/prefixcache"'
    yield 'dram_bytes = "8GiB"'
    yield 'allowed_hosts = ["cache.example.internal"]'
    yield "```"
    for title, names in GROUPS:
        yield ""
        yield f"### {title}"
        yield ""
        rows = []
        for name in names:
            field = Settings.model_fields[name]
            rows.append(
                [
                    f"`{name}`",
                    f"`{prefix}{name.upper()}`",
                    flag_text(flags[name]) if name in flags else "",
                    type_text(field.annotation, field.metadata),
                    default_text(field, name),
                    description(Settings, name),
                ]
            )
        yield from _table(["setting (file key)", "environment", "flag", "type", "default", "description"], rows)


def connector_section() -> Iterator[str]:
    yield "## The connector: `kv_connector_extra_config`"
    yield ""
    yield (
        "vLLM hands the connector the keys of `kv_connector_extra_config`, in its `--kv-transfer-config`. None "
        "is required; an unknown key stops the engine at start-up, naming it."
    )
    yield ""
    yield "```bash"
    yield "python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config \\"
    yield """  '{"kv_connector":"PrefixCacheConnector","kv_role":"kv_both","kv_connector_extra_config":{"service_url":"http://NODE_IP:8600"}}'"""
    yield "```"
    yield ""
    rows = []
    for name, field in ConnectorSettings.model_fields.items():
        rows.append(
            [
                f"`{name}`",
                type_text(field.annotation, field.metadata),
                default_text(field, name, json_values=True),
                description(ConnectorSettings, name),
            ]
        )
    yield from _table(["key", "type", "default", "description"], rows)


def proxy_section() -> Iterator[str]:
    secrets = {"auth_token": f"`{AUTH_TOKEN_ENV}`, or `--auth-token-file`", "redis_password": f"`{REDIS_PASSWORD_ENV}`"}
    yield "## The disaggregated-prefill proxy: `prefixcache proxy`"
    yield ""
    yield (
        "Set by the command's flags; its two secrets come from the environment or a file, never from a flag, "
        "which other users of the host could read. Anything invalid stops the proxy before it starts."
    )
    yield ""
    flags = {param.name: param for param in command_params("proxy") if param.name in ProxySettings.model_fields}
    unset = set(ProxySettings.model_fields) - set(flags) - set(secrets)
    if unset:
        raise ValueError(f"prefixcache proxy has no option for settings {sorted(unset)}")
    rows = []
    for name, field in ProxySettings.model_fields.items():
        rows.append(
            [
                f"`{name}`",
                secrets.get(name) or flag_text(flags[name]),
                type_text(field.annotation, field.metadata),
                default_text(field, name),
                description(ProxySettings, name),
            ]
        )
    yield from _table(["setting", "flag or source", "type", "default", "description"], rows)


def render() -> str:
    """docs/settings.md, as it should read."""
    lines = [
        "<!-- Written by `python -m devtools.settings_reference` from the settings' own "
        "descriptions (cachestore/node/settings.py, connector/settings.py, cachestore/proxy/settings.py): edit "
        "those and run it again. -->",
        "",
        "# Settings",
        "",
        "Every setting of the node daemon, the vLLM connector and the disaggregated-prefill proxy, with what it does. "
        "`prefixcache serve --help` and `prefixcache proxy --help` show each flag with a line of its own and its "
        "default; this page has the whole descriptions.",
        "",
        *daemon_section(),
        "",
        *connector_section(),
        "",
        *proxy_section(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.settings_reference",
        description="Write docs/settings.md from the settings' descriptions.",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the page differs from what would be written"
    )
    parser.add_argument("path", nargs="?", type=Path, default=REPOSITORY / DOCS_PAGE, help="the page to write")
    args = parser.parse_args(argv)
    wanted = render()
    if not args.check:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(wanted)
        return 0
    current = args.path.read_text() if args.path.exists() else ""
    if current == wanted:
        return 0
    diff = "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True), wanted.splitlines(keepends=True), str(args.path), "generated"
        )
    )
    changed = sorted(set(re.findall(r"^[-+]\| `(\w+)`", diff, flags=re.MULTILINE)))
    what = f" (settings {', '.join(changed)})" if changed else ""
    sys.stdout.write(diff)
    print(
        f"{args.path} differs from what the settings say{what}: run python -m devtools.settings_reference",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
