"""One error family: every exception class the package defines descends from ``PrefixCacheError``
(``indexer/errors.py``, the lowest layer, which every layer may import). Read from the source with ``ast``."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_ERROR = "PrefixCacheError"


def exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Each class of the package that derives from an exception (builtin, or another such class) by name: where it
    is, and the names of its bases."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for top in ("cachestore", "connector", "indexer"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    classes[node.name] = (f"{path.relative_to(ROOT)}:{node.lineno}", bases)
    exceptions = {}
    changed = True
    while changed:
        changed = False
        for name, (where, bases) in classes.items():
            builtin = [b for b in bases if isinstance(getattr(builtins, b, None), type)]
            if name not in exceptions and (
                any(issubclass(getattr(builtins, b), BaseException) for b in builtin) or set(bases) & set(exceptions)
            ):
                exceptions[name] = (where, bases)
                changed = True
    return exceptions


def in_family(name: str, exceptions: dict[str, tuple[str, list[str]]]) -> bool:
    return name == ROOT_ERROR or any(in_family(b, exceptions) for b in exceptions.get(name, ("", []))[1])


def test_every_error_of_the_package_is_a_prefixcache_error():
    exceptions = exception_classes()
    assert {ROOT_ERROR, "ConfigError", "NotFoundError", "JobNotFoundError"} <= set(exceptions)
    outside = [f"{where} {name}" for name, (where, _) in exceptions.items() if not in_family(name, exceptions)]
    assert not outside, f"errors outside the {ROOT_ERROR} family (add it to their bases):\n" + "\n".join(outside)
