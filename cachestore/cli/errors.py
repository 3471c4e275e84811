"""How every ``prefixcache`` command reports a failure: one red line on stderr and exit code 2."""

from __future__ import annotations

from typing import Literal

import typer
from rich.console import Console
from rich.markup import escape

from prefixcache.indexer.errors import PrefixCacheError

err = Console(stderr=True)


def fail(message: str) -> None:
    """Print ``message`` as the command's error and exit with code 2. The message is printed as it is: square
    brackets in it (``prefixcache[cpu]``, a server's reason) are text, not markup."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(2)


class clear_errors:
    """Turn prefixcache's own errors into one red line and exit code 2, without a traceback."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if isinstance(exc, PrefixCacheError):
            fail(str(exc))
        return False
