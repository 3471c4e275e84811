"""The Redis key tables, written from ``prefixcache.indexer.keyspace.LAYOUT``: docs/architecture.md's table and
the layout comment of indexer/lua/common.lua, each between its ``BEGIN KEY LAYOUT`` and ``END KEY LAYOUT`` marks.

A development script, not part of the package: ``python -m devtools.key_tables`` (``make docs``) rewrites both;
with ``--check`` it writes nothing and exits 1 when either differs (tests/test_keyspace.py checks the same).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from prefixcache.indexer.keyspace import docs_table, lua_layout

REPOSITORY = Path(__file__).resolve().parents[1]

#: Each generated block: the file, how its lines are marked, and what goes between the marks.
BLOCKS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "docs/architecture.md": ("<!-- {} (python -m devtools.key_tables) -->", docs_table),
    "indexer/lua/common.lua": ("-- {}", lambda: [f"--{line}" for line in lua_layout()]),
}


def rendered(path: str, text: str) -> str:
    """``text`` (the file at ``path``) with its generated block as it should read."""
    mark, lines = BLOCKS[path]
    begin, end = mark.format("BEGIN KEY LAYOUT"), mark.format("END KEY LAYOUT")
    head, found, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end + "\n")
    if not found or not found_end:
        raise ValueError(f"{path} has no {begin!r} ... {end!r} block")
    return head + begin + "\n" + "".join(line + "\n" for line in lines()) + end + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.key_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in BLOCKS:
        file = REPOSITORY / path
        text = file.read_text()
        wanted = rendered(path, text)
        if wanted != text:
            stale.append(path)
            if not args.check:
                file.write_text(wanted)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run python -m devtools.key_tables", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
