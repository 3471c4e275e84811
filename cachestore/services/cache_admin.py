"""What the admin API and CLI do to the cache: inspect, look up, evict and pin, independent of HTTP.

Selections page through the index in key order and act batch by batch, so evicting millions of
chunks holds a few hundred entries in memory at a time. Pinned chunks are never evicted unless the
request says ``force``; eviction itself (tiers, then index) belongs to ``Evictor``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefixcache.cachestore.api.models import (
    SAMPLE_KEYS,
    Chunk,
    ChunkPage,
    EvictRequest,
    EvictResult,
    Lookup,
    LookupChunk,
    NamespaceInfo,
    NamespaceRef,
    PinRequest,
    PinResult,
    PromptRef,
    Selector,
    tier_use,
)
from prefixcache.cachestore.services.eviction import Evictor
from prefixcache.cachestore.services.tokenizers import LocalTokenizers
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import PrefixCacheError
from prefixcache.indexer.index import ChunkEntry, PrefixIndex, Tier, subtree
from prefixcache.indexer.keys import PrefixHasher
from prefixcache.indexer.namespace import NamespaceSpec

BATCH = 256
#: Entries a listing examines per page at most: a selective filter returns a short page and a cursor,
#: rather than holding a request for a scan of the whole index.
PAGE_SCAN_LIMIT = 20_000
#: Chunks one prefix eviction reaches below the prefix; repeat the request for more.
MAX_SUBTREE = 1_000_000


class NotFoundError(PrefixCacheError, LookupError):
    """A named namespace or chunk does not exist (404)."""


class ConflictError(PrefixCacheError, RuntimeError):
    """The request is valid but the chunk's state forbids it (409)."""


@dataclass(frozen=True)
class EntryFilter:
    """A ``Selector`` resolved against the namespace registry, tested entry by entry."""

    selector: Selector
    namespaces: frozenset[bytes] | None  # None: any
    now_s: float

    def __call__(self, e: ChunkEntry) -> bool:
        s = self.selector
        age = self.now_s - e.created_s
        return (
            (self.namespaces is None or e.namespace in self.namespaces)
            and (s.tenant is None or e.tenant == ("" if s.tenant == "none" else s.tenant))
            and (s.tier is None or any(loc.tier == s.tier for loc in e.locations))
            and (s.pinned is None or e.pinned(self.now_s) == s.pinned)
            and (s.older_than_s is None or age > s.older_than_s)
            and (s.newer_than_s is None or age < s.newer_than_s)
            and (s.min_hits is None or e.hits >= s.min_hits)
        )


class CacheAdmin:
    def __init__(self, index: PrefixIndex, evictor: Evictor, tokenizers: LocalTokenizers | None = None) -> None:
        self.index = index
        self.evictor = evictor
        self.tokenizers = tokenizers or LocalTokenizers()

    # ---- namespaces and prompts -------------------------------------------------------------------

    def namespaces(self) -> list[NamespaceInfo]:
        usage = self.index.usage()
        out = []
        for spec in sorted(self.index.namespaces(), key=lambda s: (s.model, s.digest)):
            use = usage.get(spec.digest)
            out.append(
                NamespaceInfo(
                    namespace=spec.digest.hex(),
                    spec=spec,
                    chunks=use.entries.chunks if use else 0,
                    bytes=use.entries.bytes if use else 0,
                    tiers=tier_use(use),
                )
            )
        return out

    def resolve(self, ref: NamespaceRef) -> NamespaceSpec:
        if ref.spec is not None:
            ChunkGeometry(ref.spec.chunk_tokens)  # ConfigError (422) for an impossible chunk size
            return ref.spec
        for spec in self.index.namespaces():
            if spec.digest.hex() == ref.namespace:
                return spec
        raise NotFoundError(f"namespace {ref.namespace} is not registered; GET /v1/namespaces lists them")

    def hasher(self, prompt: PromptRef) -> tuple[NamespaceSpec, PrefixHasher]:
        """The prompt's namespace, and its keys in that namespace (and tenant)."""
        spec = self.resolve(prompt)
        if prompt.token_ids is not None:
            tokens = prompt.token_ids
        else:
            assert prompt.text is not None  # a PromptRef holds token ids or text (its validator)
            tokens = self.tokenizers.encode(spec.model, prompt.text)
        return spec, PrefixHasher(spec.root(prompt.cache_salt), ChunkGeometry(spec.chunk_tokens)).extend(tokens)

    def lookup(self, prompt: PromptRef) -> Lookup:
        """What a client would load for this prompt, per chunk and tier; hit statistics are left alone."""
        spec, hasher = self.hasher(prompt)
        query = hasher.query()
        match = self.index.lookup(query, touch=False)
        matched = [(key, query.chunk_tokens, query.chunk_tokens) for key in match.keys]
        if match.partial:
            matched.append((match.partial.key, match.partial.tokens, match.partial.stored_tokens))
        entries = self.index.get([key for key, _, _ in matched])
        chunks = [
            LookupChunk(
                key=key.hex(),
                matched_tokens=used,
                stored_tokens=stored,
                tiers=_tiers(e),
                locations=sorted(str(loc) for loc in e.locations),
            )
            for (key, used, stored), e in zip(matched, entries, strict=True)
            if e is not None
        ]
        return Lookup(
            namespace=spec.digest.hex(),
            requested_tokens=query.num_tokens,
            matched_tokens=match.matched_tokens,
            matched_chunks=len(chunks),
            chunks=chunks,
        )

    # ---- listing ----------------------------------------------------------------------------------

    def list_chunks(self, selector: Selector, cursor: str | None, limit: int) -> ChunkPage:
        keep = self._filter(selector)
        after = bytes.fromhex(cursor) if cursor else None
        found: list[ChunkEntry] = []
        examined = 0
        while len(found) < limit and examined < PAGE_SCAN_LIMIT:
            page = self.index.page(after, BATCH)
            if not page:
                return ChunkPage(chunks=[chunk_view(e, keep.now_s) for e in found], next_cursor=None)
            for entry in page:
                examined += 1
                after = entry.key
                if keep(entry):
                    found.append(entry)
                    if len(found) == limit:
                        break
        return ChunkPage(chunks=[chunk_view(e, keep.now_s) for e in found], next_cursor=after.hex() if after else None)

    def chunk(self, key: str) -> Chunk:
        return chunk_view(self._entry(key), self.index.clock_s())

    # ---- eviction ---------------------------------------------------------------------------------

    def delete_chunk(self, key: str, force: bool) -> EvictResult:
        entry = self._entry(key)
        if entry.pinned(self.index.clock_s()) and not force:
            raise ConflictError(f"chunk {key} is pinned; unpin it or pass force=true")
        return self._evict_all([[entry]], force=True, dry_run=False)

    def evict(self, request: EvictRequest) -> EvictResult:
        return self._evict_all(self._targets(request), request.force, request.dry_run)

    def _targets(self, request: EvictRequest) -> Iterator[list[ChunkEntry]]:
        if request.keys is not None:
            yield from self._entries([bytes.fromhex(k) for k in dict.fromkeys(request.keys)])
        elif request.prefix is not None:
            _, hasher = self.hasher(request.prefix)
            chain = [*hasher.keys, *filter(None, [hasher.tail_key()])]
            yield from self._entries(subtree(self.index, chain, MAX_SUBTREE))
        else:
            keep = self._filter(request.where or Selector())
            after = None
            while page := self.index.page(after, BATCH):
                after = page[-1].key
                yield [e for e in page if keep(e)]

    def _evict_all(
        self, batches: Iterator[list[ChunkEntry]] | list[list[ChunkEntry]], force: bool, dry_run: bool
    ) -> EvictResult:
        result = EvictResult(
            dry_run=dry_run, chunks=0, bytes=0, pinned_skipped=0, kept_elsewhere=0, failed=0, sample_keys=[]
        )
        now = self.index.clock_s()  # pins are deadlines in the index's clock
        for batch in batches:
            victims = [e for e in batch if force or not e.pinned(now)]
            result.pinned_skipped += len(batch) - len(victims)
            if not dry_run:
                outcome = self.evictor.evict(victims)
                result.kept_elsewhere += len(outcome.kept_elsewhere)
                result.pending_nodes = sorted({*result.pending_nodes, *outcome.pending_nodes})
                result.failed += len(outcome.failed)
                victims = outcome.removed
            result.chunks += len(victims)
            result.bytes += sum(e.size_bytes for e in victims)
            result.sample_keys += [e.key.hex() for e in victims[: SAMPLE_KEYS - len(result.sample_keys)]]
        return result

    # ---- pins -------------------------------------------------------------------------------------

    def pin(self, request: PinRequest, pin: bool) -> PinResult:
        until = (round(self.index.clock_s() + request.ttl_s, 3) if request.ttl_s else math.inf) if pin else 0.0  # ms
        if request.keys is not None:
            keys = [bytes.fromhex(k) for k in dict.fromkeys(request.keys)]
        else:
            assert request.prefix is not None  # a PinRequest holds keys or a prefix (its validator)
            query = self.hasher(request.prefix)[1].query()
            match = self.index.lookup(query, touch=False)
            keys = [*match.keys, *([match.partial.key] if match.partial else [])]
        count = sum(self.index.set_pin(keys[i : i + BATCH], until) for i in range(0, len(keys), BATCH))
        existing = [e.key.hex() for batch in self._entries(keys) for e in batch]
        return PinResult(
            chunks=count, pinned_until_s=until if 0 < until < math.inf else None, keys=existing[:SAMPLE_KEYS]
        )

    # ---- helpers ----------------------------------------------------------------------------------

    def _entries(self, keys: Sequence[bytes]) -> Iterator[list[ChunkEntry]]:
        for start in range(0, len(keys), BATCH):
            yield [e for e in self.index.get(keys[start : start + BATCH]) if e is not None]

    def _entry(self, key: str) -> ChunkEntry:
        entry = self.index.get([bytes.fromhex(key)])[0]
        if entry is None:
            raise NotFoundError(f"no chunk {key}")
        return entry

    def _filter(self, selector: Selector) -> EntryFilter:
        namespaces: set[bytes] | None = None
        if selector.namespace is not None:
            namespaces = {bytes.fromhex(selector.namespace)}
        if selector.model is not None:
            of_model = {s.digest for s in self.index.namespaces() if s.model == selector.model}
            namespaces = of_model if namespaces is None else namespaces & of_model
        return EntryFilter(selector, frozenset(namespaces) if namespaces is not None else None, self.index.clock_s())


def _tiers(entry: ChunkEntry) -> list[Tier]:
    return sorted({loc.tier for loc in entry.locations})


def chunk_view(e: ChunkEntry, now_s: float) -> Chunk:
    """An entry as the API shows it; ``now_s``: the index's clock, which pins are deadlines in."""
    pinned = e.pinned(now_s)
    return Chunk(
        key=e.key.hex(),
        namespace=e.namespace.hex(),
        tenant=e.tenant,
        parent=e.parent.hex(),
        tokens=e.num_tokens,
        bytes=e.size_bytes,
        locations=sorted(str(loc) for loc in e.locations),
        tiers=_tiers(e),
        created_s=e.created_s,
        last_access_s=e.last_access_s,
        hits=e.hits,
        pinned=pinned,
        pinned_until_s=e.pinned_until_s if pinned and e.pinned_until_s < math.inf else None,
    )
