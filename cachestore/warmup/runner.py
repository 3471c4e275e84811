"""One warm-up run: read the corpus, resume the job, start the engine, skip what is cached, compute the rest.

Order of work: the whole corpus is parsed and checked (nothing runs if a bad entry must fail the
job); a job whose prompts are all recorded stops there, without starting an engine; otherwise the
engine starts, the prompts are tokenized and checked against the model, and the waves of ``plan``
run in batches.

A prompt is recorded as done only when every chunk it should store is registered in the index. The
connector publishes from a background thread after the forward pass, so after each batch the runner
re-reads the batch's chunk entries until all are there; a prompt whose chunks do not show up within
``SETTLE_TIMEOUT_S`` (a full arena or publish queue drops chunks: they are a cache, not a log) counts
as failed and the next run retries it. The entries read before and after the batch give the chunks
and bytes it added.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixcache.cachestore.client.config import ClientConfig, fetch_config, index_url
from prefixcache.cachestore.node.settings import default_data_dir
from prefixcache.cachestore.warmup import plan
from prefixcache.cachestore.warmup.corpus import CorpusError, CorpusPrompt, Problem, check_against_model, read_corpus
from prefixcache.cachestore.warmup.engine import ConnectorOptions, WarmupEngine, engine_args
from prefixcache.cachestore.warmup.progress import Counters, Phase, ProgressReporter, eta
from prefixcache.cachestore.warmup.report import Outcome, Report
from prefixcache.cachestore.warmup.state import JobState, StateFile, job_id
from prefixcache.indexer.chunking import PROBE_TOKENS, ChunkGeometry
from prefixcache.indexer.fingerprint import fingerprint_model
from prefixcache.indexer.index import ChunkEntry
from prefixcache.indexer.keys import PrefixHasher, extend_all
from prefixcache.indexer.namespace import NamespaceSpec, tenant_id
from prefixcache.indexer.redis_index import RedisIndex

SETTLE_TIMEOUT_S = 30.0
SETTLE_POLL_S = 0.05
#: Problems listed in an error or a report; the rest are counted.
SHOWN_PROBLEMS = 20


class WarmupOptions(BaseModel):
    """Everything one run needs; the CLI flags and the REST body both end up here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: Path
    model: str = Field(min_length=1)
    tokenizer: str | None = None
    tenant: str | None = Field(default=None, min_length=1, description="cache_salt of lines without their own")
    service_url: str = "http://127.0.0.1:8600"
    state_dir: Path = Field(default_factory=lambda: default_data_dir() / "warmup")
    batch_size: int = Field(default=16, ge=1, le=4096)
    max_prompts: int | None = Field(default=None, ge=1, description="compute at most this many prompts this run")
    on_error: Literal["skip", "fail"] = "fail"
    arena_mb: int | None = Field(default=None, ge=16)
    redis_password: str | None = None
    engine_options: list[str] = []
    progress_file: Path | None = None


@dataclass
class _Prompt:
    key: str
    tokens: list[int]
    salt: str | None
    hashers: list[PrefixHasher]  # one key chain per rank (NamespaceSpec.shards): each stores its shard

    def storable_keys(self) -> list[bytes]:
        """Keys of the chunks the connector stores for this prompt, every rank's (see ``plan.storable_tokens``)."""
        keys = []
        for hasher in self.hashers:
            tail = len(self.tokens) % hasher.chunk_tokens
            tail_key = hasher.tail_key() if tail >= PROBE_TOKENS else None
            keys += [*hasher.keys, *([tail_key] if tail_key else [])]
        return keys


class WarmupRun:
    def __init__(self, options: WarmupOptions, reporter: ProgressReporter) -> None:
        self.o = options
        self.reporter = reporter
        self.counters = Counters()
        self.problems: list[Problem] = []
        self.started = time.monotonic()
        self.engine_start_s = 0.0
        self.warming_started: float | None = None
        self.warming_s = 0.0
        self.done_at_start = 0

    def run(self) -> Report:
        self._phase("reading corpus")
        config = fetch_config(self.o.service_url)
        corpus = read_corpus(self.o.corpus, self.o.tenant)
        self._accept(corpus.problems)
        state_file = StateFile(self.o.state_dir, job_id(self._identity(corpus.digest, config)))
        with state_file.exclusive():
            state = state_file.load_or_new(str(self.o.corpus), self.o.model)
            self.counters.prompts_total = len(corpus.prompts)
            pending = [p for p in corpus.prompts if p.key not in state.outcomes]
            self.counters.prompts_done_before = self.done_at_start = len(corpus.prompts) - len(pending)
            if not pending:
                return self._report("nothing_to_do", state, state_file)
            self._phase("starting engine")
            connector = ConnectorOptions(self.o.service_url, self.o.arena_mb, self.o.redis_password)
            args = engine_args(self.o.model, self.o.tokenizer, self.o.engine_options, connector)
            engine = WarmupEngine(args)
            self.engine_start_s = time.monotonic() - self.started
            try:
                outcome = self._warm(engine, config, pending, state, state_file)
            except KeyboardInterrupt:
                outcome = "interrupted"
            finally:
                self._phase("stopping engine")
                engine.close()  # drains the connector's publishing queue
            return self._report(outcome, state, state_file)

    def _identity(self, corpus_digest: str, config: ClientConfig) -> dict[str, object]:
        """What decides the chunks a job stores; the tenant salt enters only as its non-reversible id."""
        o = self.o
        return {
            "corpus": corpus_digest,
            "model": o.model,
            "fingerprint": fingerprint_model(o.model),
            "tokenizer": o.tokenizer,
            "tenant": tenant_id(o.tenant),
            "engine": o.engine_options,
            "index": [config.redis_url, config.key_prefix, config.chunk_tokens],
        }

    def _accept(self, problems: Sequence[Problem]) -> None:
        """Fail the job on bad input, or list it and go on, as ``on_error`` says."""
        if not problems:
            return
        if self.o.on_error == "fail":
            shown = "\n  ".join(str(p) for p in problems[:SHOWN_PROBLEMS])
            more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
            raise CorpusError(
                f"{len(problems)} bad corpus entries, nothing was computed "
                f"(--on-error skip leaves them out):\n  {shown}{more}"
            )
        self.problems.extend(problems)

    def _warm(
        self,
        engine: WarmupEngine,
        config: ClientConfig,
        pending: list[CorpusPrompt],
        state: JobState,
        state_file: StateFile,
    ) -> Outcome:
        specs = engine.namespaces()
        state.namespace = specs[0].digest.hex()
        ready, problems = check_against_model(pending, engine.encode, engine.limits())
        self._accept(problems)
        for problem in problems:
            state.outcomes[problem.key or problem.where] = "invalid"
        self.counters.prompts_invalid += len(problems)
        state_file.save(state)
        prompts = [
            _Prompt(r.prompt.key, r.token_ids, r.prompt.tenant, self._hashers(specs, r.prompt.tenant, r.token_ids))
            for r in ready
        ]
        index = RedisIndex(index_url(config, self.o.redis_password), key_prefix=config.key_prefix)
        self.warming_started = time.monotonic()
        try:
            return self._run_waves(engine, index, prompts, state, state_file)
        finally:
            self.warming_s = time.monotonic() - self.warming_started
            index.close()

    def _run_waves(
        self, engine: WarmupEngine, index: RedisIndex, prompts: list[_Prompt], state: JobState, state_file: StateFile
    ) -> Outcome:
        budget = self.o.max_prompts
        for wave in plan.waves([p.hashers[0].keys for p in prompts]):
            todo = [p for p in (prompts[i] for i in wave) if not self._skip_if_cached(index, p, state)]
            state_file.save(state)
            self._phase("warming")
            for batch in plan.batches(todo, self.o.batch_size):
                run_now = batch if budget is None else batch[:budget]
                if not run_now:
                    return "stopped"
                self._run_batch(engine, index, run_now, state)
                state_file.save(state)
                self._phase("warming")
                if budget is not None:
                    budget -= len(run_now)
                if len(run_now) < len(batch):
                    return "stopped"
        return "incomplete" if self.counters.prompts_failed else "finished"

    @staticmethod
    def _hashers(specs: list[NamespaceSpec], salt: str | None, tokens: list[int]) -> list[PrefixHasher]:
        """One key chain per rank (each stores its shard), the tokens converted once."""
        hashers = [PrefixHasher(spec.root(salt), ChunkGeometry(spec.chunk_tokens)) for spec in specs]
        extend_all(hashers, tokens)
        return hashers

    def _skip_if_cached(self, index: RedisIndex, prompt: _Prompt, state: JobState) -> bool:
        matches = index.lookup_many([hasher.query() for hasher in prompt.hashers])
        if not all(plan.is_warm(match, len(prompt.tokens)) for match in matches):
            return False
        state.outcomes[prompt.key] = "cached"
        self.counters.prompts_cached += 1
        self.counters.tokens_skipped += len(prompt.tokens)
        return True

    def _run_batch(self, engine: WarmupEngine, index: RedisIndex, batch: list[_Prompt], state: JobState) -> None:
        keys = list(dict.fromkeys(k for p in batch for k in p.storable_keys()))
        before = {k for k, entry in zip(keys, index.get(keys), strict=True) if entry is not None}
        reused = engine.prefill([(p.tokens, p.salt) for p in batch])
        present = self._settle(index, batch, keys)
        added = [present[k] for k in keys if k in present and k not in before]
        self.counters.chunks_added += len(added)
        self.counters.bytes_added += sum(entry.size_bytes for entry in added)
        for prompt, local_hits in zip(batch, reused, strict=True):
            self.counters.tokens_computed += len(prompt.tokens) - local_hits
            self.counters.tokens_reused += local_hits
            if all(k in present for k in prompt.storable_keys()):
                state.outcomes[prompt.key] = "warmed"
                self.counters.prompts_warmed += 1
            else:
                self.counters.prompts_failed += 1

    @staticmethod
    def _settle(index: RedisIndex, batch: list[_Prompt], keys: list[bytes]) -> dict[bytes, ChunkEntry]:
        """The batch's chunk entries once every prompt's chunks are registered, or when the wait runs out."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            present = {k: e for k, e in zip(keys, index.get(keys), strict=True) if e is not None}
            complete = all(k in present for p in batch for k in p.storable_keys())
            if complete or time.monotonic() > deadline:
                return present
            time.sleep(SETTLE_POLL_S)

    def _phase(self, phase: Phase) -> None:
        warming_s = time.monotonic() - self.warming_started if self.warming_started else 0.0
        self.reporter.update(phase, self.counters, eta(self.counters, warming_s, self.done_at_start))

    def _report(self, outcome: Outcome, state: JobState, state_file: StateFile) -> Report:
        self._phase("done")
        total = time.monotonic() - self.started
        return Report(
            job_id=state.job_id,
            outcome=outcome,
            corpus=state.corpus,
            model=state.model,
            namespace=state.namespace,
            state_file=str(state_file.path),
            counters=self.counters,
            engine_start_s=round(self.engine_start_s, 2),
            compute_s=round(self.warming_s, 2),
            total_s=round(total, 2),
            problems=[str(p) for p in self.problems[:SHOWN_PROBLEMS]],
            problems_total=len(self.problems),
        )
