"""Reconciling the index with the bucket: what the object tier holds is registered again after the index lost it.

The index (Redis) can lose entries a node's own reconcile cannot bring back (cachestore/services/reconcile.py
registers this node's NVMe tier only): a flushed or replaced Redis, a failover that lost writes, a node whose disk
went with it. The bucket holds every persisted chunk, so a pass lists it a page at a time and, for each chunk the
index lacks, reads its object (sealed, so only this cluster's are taken), registers it at ``object@<this node>``
and, for each chunk the index knows without a bucket copy, adds that location. A pass is bounded in time: one
that reaches its deadline registers what it found and stops, and the next pass starts over. Passes run at start
and every ``interval_s``; none is on a request's path.

A complete pass also keeps the tier within its own limits (``BucketLimits``): objects older than ``max_age_s`` go,
then the oldest until the bucket holds at most ``capacity_bytes``, chunks pinned or leased (``is_protected``) never;
each goes from the bucket first, then its bucket locations from the index (an entry left with none goes with them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.cachestore.services.reconcile import records_of, register
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.index import IndexRegistration, Location

if TYPE_CHECKING:  # the object extra's
    from prefixcache.cachestore.tiers.object_store import ObjectTier

log = logging.getLogger("prefixcache.bucket_reconcile")
#: Keys per ``is_protected`` call (the daemon asks the index, a round trip each).
PROTECTED_QUERY_KEYS = 256


@dataclass(frozen=True)
class BucketReconcileReport:
    listed: int  # chunks listed in the bucket
    registered: int  # entries registered from their objects
    located: int  # known entries that had no bucket location and got one
    unreadable: int  # objects that did not open or decode: left where they are, not registered
    complete: bool  # False: the pass reached its deadline before the end of the listing
    expired: int = 0  # objects removed for the tier's age or capacity limit


@dataclass(frozen=True)
class BucketLimits:
    """The object tier's own limits (None: none): its bytes, sealed, and its objects' age."""

    capacity_bytes: int | None = None
    max_age_s: float | None = None


def reconcile_bucket(
    index: IndexRegistration,
    bucket: ObjectTier,
    node: str,
    deadline_s: float,
    limits: BucketLimits = BucketLimits(),
    is_protected: Callable[[Sequence[bytes]], list[bool]] = lambda keys: [False] * len(keys),
) -> BucketReconcileReport:
    """One pass over the bucket, registering what the index lacks, stopping after ``deadline_s``; a complete one
    then applies ``limits``."""
    location = Location("object", node)
    ends = time.monotonic() + deadline_s
    listed = located = unreadable = 0
    records = []
    complete = True
    held: list[tuple[float, int, bytes]] = []  # (last modified, size, key) of every object listed
    for page in bucket.list_pages():
        listed += len(page)
        held += [(modified, size, key) for key, size, modified in page]
        keys = [key for key, _, _ in page]
        entries = index.get(keys)
        unlocated = [e.key for e in entries if e is not None and not any(loc.tier == "object" for loc in e.locations)]
        if unlocated:
            index.add_location(unlocated, location)
            located += len(unlocated)
        missing = [(key, size) for (key, size, _), entry in zip(page, entries, strict=True) if entry is None]
        if missing:
            buffers = [memoryview(bytearray(size)) for _, size in missing]
            lengths = bucket.get_into([key for key, _ in missing], buffers)
            objects = [
                (key, buffer[:length] if length > 0 else None)
                for (key, _), buffer, length in zip(missing, buffers, lengths, strict=True)
            ]
            found, bad = records_of(objects, location)
            records += found
            unreadable += len(bad)
        if time.monotonic() > ends:
            complete = False
            break
    register(index, records)
    expired = _apply(index, bucket, held, limits, is_protected) if complete else 0
    report = BucketReconcileReport(listed, len(records), located, unreadable, complete, expired)
    log.info("reconciled index with the bucket: %s", report)
    return report


def _apply(
    index: IndexRegistration,
    bucket: ObjectTier,
    held: list[tuple[float, int, bytes]],
    limits: BucketLimits,
    is_protected: Callable[[Sequence[bytes]], list[bool]],
) -> int:
    """Remove the objects past ``limits``, oldest first, none protected; how many went."""
    if limits.capacity_bytes is None and limits.max_age_s is None:
        return 0
    now = time.time()
    used = sum(size for _, size, _ in held)
    oldest = sorted(held)
    victims: list[bytes] = []
    for start in range(0, len(oldest), PROTECTED_QUERY_KEYS):
        batch = oldest[start : start + PROTECTED_QUERY_KEYS]
        protected = is_protected([key for _, _, key in batch])
        for (modified, size, key), keep in zip(batch, protected, strict=True):
            too_old = limits.max_age_s is not None and now - modified > limits.max_age_s
            too_much = limits.capacity_bytes is not None and used > limits.capacity_bytes
            if not (too_old or too_much):
                break
            if not keep:
                victims.append(key)
                used -= size
        else:
            continue
        break
    if not victims:
        return 0
    gone = [key for key, removal in zip(victims, bucket.delete(victims), strict=True) if removal.gone]
    by_location: dict[Location, list[bytes]] = {}
    for key, entry in zip(gone, index.get(gone), strict=True):
        for loc in entry.locations if entry is not None else ():
            if loc.tier == "object":
                by_location.setdefault(loc, []).append(key)
    for loc, keys in by_location.items():
        index.drop_location(keys, loc)
    return len(gone)


class BucketReconciler(BackgroundLoop):
    """``reconcile_bucket`` at start, then every ``interval_s``."""

    name = "prefixcache-bucket-reconcile"

    def __init__(
        self,
        index: IndexRegistration,
        bucket: ObjectTier,
        node: str,
        *,
        limits: BucketLimits = BucketLimits(),
        is_protected: Callable[[Sequence[bytes]], list[bool]] = lambda keys: [False] * len(keys),
        interval_s: float = 300.0,
        pass_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.limits = limits
        self.is_protected = is_protected
        self.index = index
        self.bucket = bucket
        self.node = node
        self.interval_s = interval_s
        self.pass_s = pass_s
        self.last: BucketReconcileReport | None = None

    def step(self) -> None:
        self.last = reconcile_bucket(self.index, self.bucket, self.node, self.pass_s, self.limits, self.is_protected)
        self.pause(self.interval_s)
