"""The help of a command's options, from the settings' own ``Field`` (their one-line ``short``) and defaults.

``prefixcache serve``'s options take their help from here; the settings page (docs/settings.md, written by
``devtools/settings_reference.py``, a development script outside the package) shows the same defaults through
``default_text``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from prefixcache.cachestore.node.settings import Settings, default_data_dir

#: Defaults computed at start-up, as the page shows them (the machine that renders it is not the one that runs).
FACTORY_DEFAULTS = {
    "data_dir": f"`~/{default_data_dir().relative_to(Path.home()).as_posix()}`",
    "node": "the host's name",
}

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def short_help(model: type[BaseModel], name: str) -> str:
    """The one-line help of setting ``name`` of ``model`` (its ``json_schema_extra`` ``short``), which a command's
    option shows; the settings page has the whole description."""
    extra = model.model_fields[name].json_schema_extra
    short = extra.get("short") if isinstance(extra, dict) else None
    if not isinstance(short, str) or not short.strip():
        raise ValueError(f"{model.__name__}.{name} has no one-line help: give its Field json_schema_extra short")
    return short


def field_help(name: str, *, model: type[BaseModel] = Settings, repeated: bool = False) -> str:
    """The help of a command's option for setting ``name`` of ``model`` (``prefixcache serve``'s, by default): its
    one line (``short_help``), as the terminal shows it (no backticks; brackets escaped from Rich's markup), and its
    default where it has one. A ``repeated`` option takes one value a time."""
    from rich.markup import escape

    text = short_help(model, name).replace("`", "")
    if repeated:
        text += " (repeatable)"
    field = model.model_fields[name]
    default = default_text(field, name)
    if field.annotation is not bool and default not in ("unset", "empty", "required"):
        text += f" [default: {default.replace('`', '')}]"
    return escape(text)


def size_text(size: int) -> str:
    """``size`` bytes in the largest binary unit that divides it: ``2GiB``, ``1KiB``, ``1000``."""
    for unit, scale in _UNITS:
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def default_text(field: FieldInfo, name: str, *, json_values: bool = False) -> str:
    """The default of ``field`` as the page shows it: as written in the environment (or, with ``json_values``, in
    JSON), ``unset`` for None, ``required`` where there is none."""
    if field.default_factory is not None:
        return FACTORY_DEFAULTS[name]
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if value in ("", []):
        return "empty"
    if json_values:
        return f"`{json.dumps(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, ByteSize):
        return f"`{size_text(int(value))}`"
    return f"`{value}`"
