"""Pure arithmetic of the connector's plans: which stored pages go to which blocks, which chunks to publish (as a
prompt is computed, and when a request finishes)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from prefixcache.connector.load_costs import HitPart, ReadPath
from prefixcache.connector.metadata import LoadChunk
from prefixcache.indexer.chunking import PROBE_TOKENS, ChunkGeometry
from prefixcache.indexer.index import PrefixMatch


def load_plan(match: PrefixMatch, blocks: list[int], start: int, end: int, g: ChunkGeometry) -> list[LoadChunk]:
    """Chunks of ``match`` covering tokens [start, end), with the request blocks their pages go to.

    ``start`` is block-aligned (what vLLM's own prefix cache holds); a chunk it cuts is loaded from
    the page where the local copy ends.
    """
    c = g.chunk_tokens
    nvme_only = match.on_nvme_alone
    stored = [(key, c) for key in match.keys]
    if match.partial is not None:
        stored.append((match.partial.key, match.partial.stored_tokens))
    plan = []
    for i, (key, stored_tokens) in enumerate(stored):
        lo, hi = max(start, i * c), min(end, i * c + stored_tokens)
        if lo < hi:
            span = g.blocks(lo, hi)
            plan.append(
                LoadChunk(
                    key,
                    stored_tokens,
                    span.start - i * c // g.engine_block_tokens,
                    blocks[span],
                    in_dram=i not in nvme_only,
                    ends_mid_block=hi % g.engine_block_tokens != 0,
                    remote=i in match.remote_dram,
                )
            )
    return plan


def tokens_by_tier(matches: Sequence[PrefixMatch], start: int, end: int) -> tuple[int, int]:
    """Tokens [start, end) of a hit, split by the tier they are expected from: (DRAM, NVMe). A chunk the index
    lists on NVMe alone on any rank counts as NVMe's."""
    c = matches[0].chunk_tokens
    nvme_only = frozenset().union(*(match.on_nvme_alone for match in matches))
    from_nvme = sum(max(0, min(end, (i + 1) * c) - max(start, i * c)) for i in nvme_only)
    return end - start - from_nvme, from_nvme


def hit_parts(matches: Sequence[PrefixMatch], start: int, end: int) -> list[HitPart]:
    """Tokens [start, end) of a hit, chunk by chunk, with the path each comes over (connector/load_costs.py): another
    node's DRAM where any rank's copies lie only there, else NVMe where any rank's lie there alone, else this node's
    DRAM. Neighbouring chunks over one path make one part."""
    c = matches[0].chunk_tokens
    remote = frozenset().union(*(match.remote_dram for match in matches))
    nvme_only = frozenset().union(*(match.on_nvme_alone for match in matches))
    parts: list[HitPart] = []
    for i in range(start // c, -(-end // c)):
        tokens = min(end, (i + 1) * c) - max(start, i * c)
        path: ReadPath = "remote_dram" if i in remote else "nvme" if i in nvme_only else "local_dram"
        if parts and parts[-1].path == path:
            parts[-1] = HitPart(parts[-1].tokens + tokens, path)
        else:
            parts.append(HitPart(tokens, path))
    return parts


def read_from_disk(plan: Sequence[LoadChunk]) -> list[bytes]:
    """The keys of a load plan's chunks the lookup found on NVMe alone: the worker reads those from this node's pack
    files, at the extents the scheduler side asks this node's daemon for as it plans the load."""
    return [chunk.key for chunk in plan if not chunk.in_dram]


def blocks_of(plan: Sequence[LoadChunk]) -> frozenset[int]:
    """The request blocks a load plan writes."""
    return frozenset(block for chunk in plan for block in chunk.blocks)


def stored_prefix(matches: Sequence[PrefixMatch], tail_keys: Sequence[bytes | None]) -> tuple[int, bool]:
    """What the lookup found stored on every rank: how many leading full chunks, and whether the prompt's own
    tail (``tail_keys``, per rank) too. Neither is published again, whether the request loads it or vLLM's own
    prefix cache held it already."""
    full = min(len(match.keys) for match in matches)
    tail = all(
        match.partial is not None and match.partial.key == key for match, key in zip(matches, tail_keys, strict=True)
    )
    return full, tail


def chunks_to_publish(
    stored_chunks: int, computed: int, prompt_tokens: int, tail_done: bool, g: ChunkGeometry
) -> tuple[list[tuple[int, int]], bool]:
    """Token ranges of the prompt chunks newly complete once ``computed`` tokens are, and whether the tail is done.

    Full chunks go as soon as they are computed; the tail goes once the whole prompt is, if it is at
    least PROBE_TOKENS long (a shorter one could never be found).
    """
    c = g.chunk_tokens
    done = min(computed, prompt_tokens)
    ranges = [(i * c, (i + 1) * c) for i in range(stored_chunks, done // c)]
    full = prompt_tokens // c
    if done == prompt_tokens and not tail_done and max(stored_chunks, done // c) >= full:
        if prompt_tokens - full * c >= PROBE_TOKENS:
            ranges.append((full * c, prompt_tokens))
        return ranges, True
    return ranges, tail_done


def chunks_at_finish(stored_chunks: int, computed: int, prompt_tokens: int, g: ChunkGeometry) -> list[tuple[int, int]]:
    """Token ranges to publish when a request finishes with the KV of its first ``computed`` tokens in its pages
    (its prompt and every generated token but the last, whose KV no step computed): the full chunks past the
    ``stored_chunks`` known to be stored, and the tail if it is at least PROBE_TOKENS long.

    A request that generated nothing past its prompt has nothing left to publish: its prompt's chunks and tail went
    as they were computed (``chunks_to_publish``).
    """
    if computed <= prompt_tokens:
        return []
    c = g.chunk_tokens
    full = computed // c
    ranges = [(i * c, (i + 1) * c) for i in range(stored_chunks, full)]
    if full >= stored_chunks and computed - full * c >= PROBE_TOKENS:
        ranges.append((full * c, computed))
    return ranges


def chunks_before_failure(blocks: Sequence[int], failed: Collection[int], g: ChunkGeometry) -> int:
    """How many of a request's leading chunks lie wholly before the first of its ``blocks`` that failed to load.
    vLLM computes the request again from that block, so every chunk from there on is to be published again."""
    first = min((i for i, block in enumerate(blocks) if block in failed), default=0)
    return first * g.engine_block_tokens // g.chunk_tokens
