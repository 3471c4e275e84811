"""What a warm-up run skips, and in which order it computes the rest (pure logic, no engine, no index).

**Skip.** A prompt is warm when the index holds everything the connector would store for it: every
full chunk, plus the tail when it has at least PROBE_TOKENS tokens (a shorter tail could never be
found, so the connector never stores one). One lookup per prompt decides it: the longest cached
prefix must reach that far. A partial hit counts: a stored chunk that starts with the whole tail is
loaded by a consumer just the same.

**Order.** Prompts that share full chunks must not run side by side, or each would compute the
shared prefix. Each prompt waits for the first prompt (in corpus order) holding the deepest chunk
it shares, so it runs one *wave* later; with vLLM's own prefix cache on, it then reuses the shared
blocks and computes only its own part. Every prompt is looked up just before its wave runs, so one
that earlier waves covered entirely (a bare system prompt before its longer variants, say) is
skipped instead of run, still with one lookup per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from prefixcache.indexer.chunking import PROBE_TOKENS
from prefixcache.indexer.index import PrefixMatch

T = TypeVar("T")


def storable_tokens(num_tokens: int, chunk_tokens: int) -> int:
    """Tokens of a prompt the connector stores: its full chunks, and its tail if long enough to be found."""
    full = num_tokens - num_tokens % chunk_tokens
    return num_tokens if num_tokens - full >= PROBE_TOKENS else full


def is_warm(match: PrefixMatch, num_tokens: int) -> bool:
    """Whether the index already holds every token of the prompt that a warm-up would store."""
    return match.matched_tokens >= storable_tokens(num_tokens, match.chunk_tokens)


def waves(chains: Sequence[Sequence[bytes]]) -> list[list[int]]:
    """Indices of the prompts (given by their full-chunk key chains), grouped into dependency waves.

    Keys chain, so the chunks a prompt shares with earlier prompts form a prefix of its chain; the
    prompt that first holds the deepest of them computes the whole shared part, and this prompt
    runs one wave after it.
    """
    owner: dict[bytes, int] = {}
    for i, chain in enumerate(chains):
        for key in chain:
            owner.setdefault(key, i)
    level: list[int] = []
    for i, chain in enumerate(chains):
        source = next((owner[k] for k in reversed(chain) if owner[k] != i), None)
        level.append(0 if source is None else level[source] + 1)
    grouped: list[list[int]] = [[] for _ in range(max(level, default=-1) + 1)]
    for i, lvl in enumerate(level):
        grouped[lvl].append(i)
    return grouped


def batches(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
