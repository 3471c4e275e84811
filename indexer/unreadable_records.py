"""Index records this version cannot read: skipped, and each logged once.

One Redis serves every version of prefixcache in a cluster, so during a rolling upgrade it holds records
written by a newer version (a namespace description with a field this one does not know, an entry of
another shape), and a damaged record can hold anything. Such a record is not this version's to use: it
is left out of what the index returns (a namespace not listed, an entry missed), never an error that
fails a listing or a connector's start. Each is logged the first time it is met, so that a lasting
mix of versions is visible without a line per lookup.
"""

from __future__ import annotations

import logging

log = logging.getLogger("prefixcache.index")

#: Records remembered as logged; past that, further ones are logged at debug level only.
REMEMBERED = 1024


class UnreadableRecords:
    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def skip(self, kind: str, name: str, problem: Exception) -> None:
        """Note that the ``kind`` record ``name`` was left out because of ``problem``."""
        seen = (kind, name)
        if seen in self._logged or len(self._logged) >= REMEMBERED:
            log.debug("skipped unreadable %s %s: %s", kind, name, problem)
            return
        self._logged.add(seen)
        log.warning(
            "skipping %s %s: this version cannot read it (written by another version, or damaged): %s",
            kind,
            name,
            problem,
        )
