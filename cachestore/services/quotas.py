"""Quota enforcement: a tenant or namespace near its quota loses its own least recently used chunks, and
publishers learn how much each may still add (indexer/quotas.py says what a quota bounds and where quotas live).

One daemon of the cluster enforces at a time (``QuotaStore.take_turn``), every ``interval_s`` and at once when a
quota changes. A round reads usage from the index's counters. A scope holding more than ``low`` x its quota is
trimmed down to that: the index is paged through for its entries, and those neither pinned nor leased
(``is_protected``) go, oldest last access first, like an operator's eviction (every tier, every node:
``Evictor``). Then the round writes each scope's room, its quota less what it holds, which publishers spend until
the next round (``QuotaGate``). A busy tenant so keeps publishing its newest chunks, up to ``1 - low`` of its
quota per round, in place of its own oldest; an idle one rests at ``low`` x its quota at most. Pinned chunks count
and stay: a scope whose pins alone fill its quota has no room, and its publishes are skipped until a pin ends or
the quota grows.

A busy tenant is above its low mark every round, so a round must not read the whole index (at millions of chunks,
seconds of Redis's time): it reads at most ``scan_entries`` entries, on from where the last round stopped, and its
victims are the least recently used of the scope's entries among those. So a round costs the same however large
the index, and a scope's oldest chunks go first within each window of the index read, as Redis's own eviction
picks the oldest of a sample; an index of up to ``scan_entries`` chunks is read whole every round, and its victims
are exactly the scope's oldest. A scope far above its mark (a quota lowered) comes down over as many rounds as the
index holds windows, its room nothing meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prefixcache.cachestore.services.eviction import Evictor
from prefixcache.indexer.background_loop import PeriodicLoop
from prefixcache.indexer.index import ChunkEntry, NamespaceUsage, PrefixIndex, Usage
from prefixcache.indexer.quotas import NO_TENANT, QuotaScope, QuotaStore, scopes_of

log = logging.getLogger("prefixcache.quotas")
#: Entries checked for pins and leases, and evicted, per call.
BATCH = 512

QuotaSource = Literal["api", "settings", "default"]


@dataclass(frozen=True)
class QuotaState:
    """One scope's quota, where it comes from, and what the scope holds now."""

    scope: QuotaScope
    limit_bytes: int
    source: QuotaSource
    used: Usage
    #: chunks this daemon evicted to keep the scope within its quota, since it started
    evicted_chunks: int

    @property
    def at_quota(self) -> bool:
        return self.used.bytes >= self.limit_bytes


class QuotaEnforcer(PeriodicLoop):
    name = "prefixcache-quotas"

    def __init__(
        self,
        index: PrefixIndex,
        store: QuotaStore,
        evictor: Evictor,
        node: str,
        is_protected: Callable[[Sequence[bytes]], list[bool]],
        *,
        configured: dict[QuotaScope, int] | None = None,
        default_tenant_bytes: int | None = None,
        scan_entries: int,
        low: float = 0.9,
        interval_s: float = 1.0,
    ) -> None:
        """``configured``: the settings' quotas, which a quota set through the API replaces; ``default_tenant_bytes``:
        the quota of every tenant with a salt that has none; ``scan_entries``: the index entries a round reads at
        most (setting ``quota_scan_entries``)."""
        super().__init__(interval_s)
        self.index = index
        self.store = store
        self.evictor = evictor
        self.node = node
        self.is_protected = is_protected
        self.configured = dict(configured or {})
        self.default_tenant_bytes = default_tenant_bytes
        self.low = low
        self.scan_entries = scan_entries
        self.evicted: Counter[QuotaScope] = Counter()
        self._reading: Iterator[ChunkEntry] | None = None  # the index read on from round to round

    def tick(self) -> None:
        """One round, if it is this daemon's turn (at once when a quota changed: the API pokes it)."""
        if self.store.take_turn(self.node, hold_s=3 * self.interval_s):
            self.run_once()

    def states(
        self, usage: Mapping[bytes, NamespaceUsage] | None = None, tenants: Mapping[str, Usage] | None = None
    ) -> list[QuotaState]:
        """Every scope with a quota, and what it holds, from the index's usage counters (``usage`` and
        ``tenants``: those counters read already, as ``PrefixIndex.usage`` and ``tenant_usage`` return them)."""
        tenants = self.index.tenant_usage() if tenants is None else tenants
        usage = self.index.usage() if usage is None else usage
        namespaces = {ns.hex(): use.entries for ns, use in usage.items()}
        limits: dict[QuotaScope, tuple[int, QuotaSource]] = {}
        if self.default_tenant_bytes is not None:
            for tenant in tenants:
                if tenant:
                    limits[QuotaScope.of_tenant(tenant)] = (self.default_tenant_bytes, "default")
        limits.update({scope: (limit, "settings") for scope, limit in self.configured.items()})
        limits.update({scope: (limit, "api") for scope, limit in self.store.all().items()})
        states = []
        for scope, (limit, source) in sorted(limits.items()):
            if scope.kind == "tenant":
                used = tenants.get("" if scope.id == NO_TENANT else scope.id, Usage())
            else:
                used = namespaces.get(scope.id, Usage())
            states.append(QuotaState(scope, limit, source, used, self.evicted[scope]))
        return states

    def run_once(self) -> int:
        """Evict every scope above its low mark down to it, then write each scope's room; returns the chunks
        evicted."""
        states = self.states()
        low = {s.scope: int(self.low * s.limit_bytes) for s in states}
        excess = {s.scope: s.used.bytes - low[s.scope] for s in states if s.used.bytes > low[s.scope]}
        evicted = self._evict(excess) if excess else 0
        if evicted:
            states = self.states()
        room = {s.scope: max(0, s.limit_bytes - s.used.bytes) for s in states}
        self.store.set_room(f"{self.node}:{time.time_ns()}", room)
        return evicted

    def _evict(self, excess: dict[QuotaScope, int]) -> int:
        """Evict the least recently used unprotected chunks of each scope until ``excess`` bytes of it are gone."""
        held: dict[QuotaScope, dict[bytes, ChunkEntry]] = {scope: {} for scope in excess}
        for entry in self._read_on():
            for scope in scopes_of(entry.tenant, entry.namespace):
                if scope in held:
                    held[scope][entry.key] = entry
        chosen: dict[bytes, ChunkEntry] = {}
        for scope, found in held.items():
            # what this scope's chunks chosen for another scope (its tenant's, its namespace's) already free
            need = excess[scope] - sum(e.size_bytes for e in chosen.values() if scope.holds(e))
            entries = sorted(found.values(), key=lambda e: e.last_access_s)
            for start in range(0, len(entries), BATCH):
                if need <= 0:
                    break
                batch = [e for e in entries[start : start + BATCH] if e.key not in chosen]
                for entry, protected in zip(batch, self.is_protected([e.key for e in batch]), strict=True):
                    if need <= 0:
                        break
                    if not protected:
                        chosen[entry.key] = entry
                        need -= entry.size_bytes
        victims = list(chosen.values())
        removed = 0
        for start in range(0, len(victims), BATCH):
            outcome = self.evictor.evict(victims[start : start + BATCH])
            for entry in outcome.removed:
                self.evicted.update(scope for scope in scopes_of(entry.tenant, entry.namespace) if scope in excess)
            removed += len(outcome.removed)
        if victims:
            log.info(
                "quotas: evicted %d of %d chunks chosen from %s, above their low mark",
                removed,
                len(victims),
                ", ".join(str(scope) for scope in excess),
            )
        return removed

    def _read_on(self) -> Iterator[ChunkEntry]:
        """At most ``scan_entries`` entries of the index, on from where the last round stopped. Its end starts it
        again from its beginning, unless this round began there: a small index is read once a round. An index that
        fails mid-way is read from its beginning next round."""
        wrapped, read = self._reading is None, 0
        while read < self.scan_entries:
            if self._reading is None:
                self._reading = self.index.scan()
            try:
                entry = next(self._reading, None)
            except Exception:
                self._reading = None
                raise
            if entry is None:
                self._reading = None
                if wrapped:
                    return
                wrapped = True
                continue
            read += 1
            yield entry
