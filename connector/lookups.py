"""Index lookups of the requests vLLM adds together, made together: one round trip for a burst of them.

vLLM asks the scheduler side about each waiting request in turn (``get_num_new_matched_tokens``) while
it schedules a step, on its one scheduling thread, and each lookup is a Redis round trip (longer where
Redis runs on another host). A burst of requests that all hit, which vLLM
schedules in one pass since each computes one token, would hold that pass up by a round trip per
request. vLLM tells the connector of each request as it adds it (``on_new_request``), before the pass
that schedules it. So the scheduler side notes each new request's queries here, and the first lookup
of a pass takes, with its own, those of every request added since the last pass (up to
``max_batch``), in one ``lookup_many`` call: one Lua script, one round trip.

A lookup made for a request that vLLM does not reach in that pass (its token budget spent) is not
used later: the request is looked up again when vLLM reaches it, so that it sees what the requests
scheduled before it published meanwhile, as it would have without this batching.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from prefixcache.indexer.index import IndexLookup, PrefixMatch
from prefixcache.indexer.keys import PrefixQuery

#: Requests looked up in one call at most: a Lua script holds Redis up while it runs, so a burst is split into
#: calls short enough not to stall the index's other clients.
MAX_BATCH = 64

_Noted = tuple[int, Sequence[PrefixQuery]]  # the request's length when noted, and its queries (one per shard)
_Made = tuple[int, list[PrefixMatch], float]  # the request's length, its matches, and the call's seconds


class BatchedLookups:
    """The scheduler side's lookups: ``note`` each request as vLLM adds it, ask ``matches`` when vLLM asks about
    it, and call ``new_pass`` once vLLM has scheduled a step."""

    def __init__(
        self,
        index: IndexLookup,
        max_batch: int = MAX_BATCH,
        avoid: Callable[[], AbstractSet[str]] = frozenset,
        here: Callable[[], str] = str,
    ) -> None:
        """``avoid`` names, at each call, the nodes whose copies lookups skip (down or suspect: indexer/peers.py);
        ``here``, at each call, this engine's node, so that matches say which DRAM copies lie on other nodes (``""``
        where it has no other: every copy is its own, and the lookup need not ask)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._index = index
        self._avoid = avoid
        self._here = here
        self._max_batch = max_batch
        self._arrived: dict[str, _Noted] = {}  # requests added since the last pass, in order, not looked up yet
        self._made: dict[str, _Made] = {}  # this pass's lookups of requests vLLM has not asked about yet

    def note(self, request_id: str, tokens: int, queries: Sequence[PrefixQuery]) -> None:
        """A request vLLM has just added (``tokens`` long): look it up with the next lookup of this pass."""
        self._arrived[request_id] = (tokens, queries)

    def matches(
        self, request_id: str, tokens: int, queries: Callable[[], Sequence[PrefixQuery]]
    ) -> tuple[list[PrefixMatch], float]:
        """The request's matches, one per query, and how long the index call that made them took: made by
        an earlier call of this pass if one looked it up at ``tokens``, else now, with the requests
        noted since the last pass. Raises ``IndexUnavailableError``; the requests it would have looked up
        are then looked up when vLLM asks about them."""
        made = self._made.pop(request_id, None)
        noted = self._arrived.pop(request_id, None)
        if made is not None and made[0] == tokens:
            self._index.touch(made[1])
            return made[1], made[2]
        own = noted[1] if noted is not None and noted[0] == tokens else queries()
        others = list(itertools.islice(self._arrived.items(), self._max_batch - 1))
        for other, _ in others:
            del self._arrived[other]
        batch: list[tuple[str, _Noted]] = [(request_id, (tokens, own)), *others]
        started = time.perf_counter()
        # only the matches taken count as used (last access, hits): a request vLLM does not reach this pass is
        # looked up again when it does
        found = self._index.lookup_many(
            [query for _, (_, group) in batch for query in group], touch=False, avoid=self._avoid(), here=self._here()
        )
        seconds = time.perf_counter() - started
        starts = itertools.accumulate((len(group) for _, (_, group) in batch), initial=0)
        for (rid, (length, group)), start in zip(batch, starts, strict=False):  # starts has one more: the end
            self._made[rid] = (length, found[start : start + len(group)], seconds)
        _, matches, seconds = self._made.pop(request_id)
        self._index.touch(matches)
        return matches, seconds

    def answered(self, request_id: str, matches: list[PrefixMatch]) -> None:
        """The request needs no lookup: its ``matches`` are known without one (connector/known_stored.py). It is
        left out of the next lookup, and its matches are recorded as used, as a lookup's are."""
        self.forget(request_id)
        self._index.touch(matches)

    def new_pass(self) -> None:
        """vLLM has scheduled a step: what was looked up for requests it did not reach is dropped. Those requests
        are looked up when vLLM reaches them, with the requests added after them."""
        self._arrived.clear()
        self._made.clear()

    def forget(self, request_id: str) -> None:
        """The request is finished (or aborted before vLLM scheduled it)."""
        self._arrived.pop(request_id, None)
        self._made.pop(request_id, None)
