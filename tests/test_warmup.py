"""Warm-up logic without an engine: corpus parsing and checks, the job state file, skip and order planning."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from prefixcache.cachestore.warmup import plan
from prefixcache.cachestore.warmup.corpus import CorpusError, ModelLimits, check_against_model, read_corpus
from prefixcache.cachestore.warmup.state import JobBusyError, StateFile, job_id
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import PartialHit, PrefixMatch
from prefixcache.indexer.keys import PrefixHasher
from prefixcache.indexer.namespace import NamespaceSpec


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# -- corpus ------------------------------------------------------------------------------------------


def test_jsonl_prompts_with_ids_tenants_and_defaults(tmp_path: Path) -> None:
    corpus = read_corpus(
        write_lines(
            tmp_path / "c.jsonl", {"prompt": "hello", "id": "greet"}, "", {"token_ids": [5, 6, 7], "tenant": "acme"}
        ),
        default_tenant="base",
    )
    assert corpus.problems == []
    first, second = corpus.prompts
    assert (first.key, first.text, first.token_ids, first.tenant) == ("greet", "hello", None, "base")
    assert (second.key, second.where, second.token_ids, second.tenant) == ("line 3", "c.jsonl:3", (5, 6, 7), "acme")


def test_every_bad_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        {"prompt": "fine", "id": 1},
        "{not json",
        {"promt": "typo"},
        {"prompt": "x", "token_ids": [1]},
        {"token_ids": [1, "2"]},
        {"token_ids": [1, -3]},
        {"token_ids": []},
        {"prompt": "dup", "id": 1},
        ["a", "list"],
        {"prompt": "also fine", "tenant": ""},
    )
    (tmp_path / "c.jsonl").write_bytes(path.read_bytes() + b'{"prompt": "\xff"}\n')
    corpus = read_corpus(path)
    assert [p.key for p in corpus.prompts] == ["1"]
    where = {p.where: p.message for p in corpus.problems}
    assert set(where) == {f"c.jsonl:{n}" for n in range(2, 12)}
    assert where["c.jsonl:2"].startswith("not JSON")
    assert "promt: unknown key" in where["c.jsonl:3"]
    assert "exactly one of 'prompt'" in where["c.jsonl:4"]
    assert where["c.jsonl:5"].startswith("token_ids.1:")
    assert "token id -3 is outside" in where["c.jsonl:6"]
    assert where["c.jsonl:7"].startswith("token_ids:")
    assert where["c.jsonl:8"] == "id '1' is already used at c.jsonl:1"
    assert where["c.jsonl:10"].startswith("tenant:")
    assert where["c.jsonl:11"] == "not UTF-8"


def test_a_folder_is_one_prompt_per_file_in_path_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / ".hidden").write_text("ignored")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    corpus = read_corpus(tmp_path, default_tenant="t")
    assert [(p.key, p.text, p.tenant) for p in corpus.prompts] == [
        ("a.txt", "first", "t"),
        ("b/two.txt", "second\n", "t"),
    ]
    assert [str(p) for p in corpus.problems] == ["empty.txt: empty", "latin1.txt: not UTF-8 (byte 3)"]
    before = corpus.digest
    (tmp_path / "a.txt").write_text("changed")
    assert read_corpus(tmp_path).digest != before


def test_a_corpus_that_cannot_be_read_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="neither a file nor a folder"):
        read_corpus(tmp_path / "missing.jsonl")
    with pytest.raises(CorpusError, match="holds no prompts"):
        read_corpus(write_lines(tmp_path / "blank.jsonl", "", "  "))


def test_model_checks_tokenize_text_and_reject_what_the_engine_would(tmp_path: Path) -> None:
    corpus = read_corpus(
        write_lines(
            tmp_path / "c.jsonl",
            {"prompt": "w " * 20},
            {"token_ids": list(range(10))},
            {"token_ids": list(range(40))},
            {"token_ids": [3] * 20 + [999]},
            {"prompt": "ok " * 30},
        )
    )

    def encode(text: str) -> list[int]:
        return [7] * len(text.split())

    ready, problems = check_against_model(corpus.prompts, encode, ModelLimits(max_token_id=500, max_model_len=32))
    assert [(r.prompt.key, len(r.token_ids)) for r in ready] == [("line 1", 20), ("line 5", 30)]
    assert [(p.key, p.message) for p in problems] == [
        ("line 2", "10 tokens: a cached prefix needs at least 16"),
        ("line 3", "40 tokens: the engine's max_model_len is 32 (one must be generated)"),
        ("line 4", "token id 999 is outside the model's vocabulary (0..500)"),
    ]


# -- state ---------------------------------------------------------------------------------------------


def test_state_survives_a_reload_and_is_replaced_whole(tmp_path: Path) -> None:
    store = StateFile(tmp_path / "state", "job1")
    state = store.load_or_new("c.jsonl", "m")
    assert state.outcomes == {}
    state.outcomes["a"] = "warmed"
    store.save(state)
    state.outcomes["b"] = "cached"
    store.save(state)
    again = StateFile(tmp_path / "state", "job1").load_or_new("c.jsonl", "m")
    assert again.outcomes == {"a": "warmed", "b": "cached"}
    assert again.pending(["a", "b", "c"]) == ["c"]
    assert [p.name for p in (tmp_path / "state").iterdir() if p.suffix != ".lock"] == ["job1.json"]  # no temp files


def test_a_damaged_state_file_is_named_not_silently_restarted(tmp_path: Path) -> None:
    (tmp_path / "job1.json").write_text('{"job_id": "job1", "outcomes": ')
    with pytest.raises(ConfigError, match=r"job1.json is damaged \(Invalid JSON: EOF.*\); delete it"):
        StateFile(tmp_path, "job1").load_or_new("c", "m")


def _hold_lock(directory: str, ready, release) -> None:  # runs in a child process
    with StateFile(Path(directory), "job1").exclusive():
        ready.set()
        release.wait(30)


def test_one_process_at_a_time_runs_a_job(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(JobBusyError, match="already running"), StateFile(tmp_path, "job1").exclusive():
            pass
    finally:
        release.set()
        holder.join(30)
    with StateFile(tmp_path, "job1").exclusive():  # free again once the holder is gone
        pass


def test_job_id_depends_on_every_input_but_not_on_key_order() -> None:
    base = {"corpus": "c1", "model": "m", "engine": ["--dtype", "bfloat16"]}
    assert job_id(base) == job_id(dict(reversed(base.items())))
    assert job_id(base) != job_id({**base, "corpus": "c2"})
    assert job_id(base) != job_id({**base, "engine": []})


# -- plan ----------------------------------------------------------------------------------------------


def test_storable_tokens_are_full_chunks_plus_a_findable_tail() -> None:
    assert plan.storable_tokens(600, 256) == 600  # tail of 88 >= 16
    assert plan.storable_tokens(520, 256) == 512  # tail of 8 is never stored
    assert plan.storable_tokens(512, 256) == 512
    assert plan.storable_tokens(100, 256) == 100


def test_a_prompt_is_warm_when_the_lookup_reaches_everything_it_would_store() -> None:
    keys = [b"k" * 16, b"j" * 16]
    assert plan.is_warm(PrefixMatch(keys=keys, chunk_tokens=256), 520)
    assert not plan.is_warm(PrefixMatch(keys=keys, chunk_tokens=256), 600)
    tail_covered = PrefixMatch(
        keys=keys, chunk_tokens=256, partial=PartialHit(key=b"p" * 16, tokens=88, stored_tokens=256)
    )
    assert plan.is_warm(tail_covered, 600)  # another chunk starts with the whole tail
    short = PrefixMatch(keys=keys, chunk_tokens=256, partial=PartialHit(key=b"p" * 16, tokens=40, stored_tokens=256))
    assert not plan.is_warm(short, 600)


def _chains(*prompts: list[int], chunk: int = 4) -> list[list[bytes]]:
    return [PrefixHasher(b"r" * 16, ChunkGeometry(chunk)).extend(p).keys for p in prompts]


def test_prompts_sharing_a_prefix_run_after_the_one_that_computes_it() -> None:
    system, other = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9, 9, 9]
    a = system + [10, 11, 12, 13]
    b = system + [20, 21, 22, 23]
    c = system + [20, 21, 22, 23, 30, 31, 32, 33]  # shares one more chunk with b than with a
    d = other
    bare = system  # covered entirely by a: looked up again before its wave, then skipped
    assert plan.waves(_chains(a, b, c, d, bare)) == [[0, 3], [1, 4], [2]]
    assert plan.waves(_chains(d, [1, 2, 3])) == [[0, 1]]  # no full chunk shared: side by side
    assert plan.waves([]) == []


def test_batches_split_in_order() -> None:
    assert plan.batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


# -- engine options ------------------------------------------------------------------------------------


def test_engine_options_are_vllm_serve_options_and_the_connector_is_always_the_warmups(tmp_path: Path) -> None:
    from prefixcache.cachestore.warmup.engine import ConnectorOptions, engine_args

    connector = ConnectorOptions("http://127.0.0.1:8600", arena_mb=64)
    args = engine_args(str(tmp_path), None, ["--dtype", "bfloat16", "--max_model_len", "4096"], connector)
    assert (args.model, args.dtype, args.max_model_len, args.enable_prefix_caching) == (
        str(tmp_path),
        "bfloat16",
        4096,
        True,
    )
    assert args.kv_transfer_config.kv_role == "kv_producer"
    assert args.kv_transfer_config.kv_connector_extra_config == {"service_url": "http://127.0.0.1:8600", "arena_mb": 64}
    assert not engine_args(str(tmp_path), None, ["--no-enable-prefix-caching"], connector).enable_prefix_caching
    for options, message in [
        (["--model", "other"], "--model is not accepted here"),
        (["--kv-transfer-config", '{"kv_connector": "X", "kv_role": "kv_both"}'], "configures PrefixCacheConnector"),
        (["--max-model-len"], "expected one argument"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            engine_args(str(tmp_path), None, options, connector)


def test_the_workers_namespaces_must_be_every_shard_of_one_engine_as_often_as_each_other() -> None:
    from prefixcache.cachestore.warmup.engine import engine_shards

    engine = NamespaceSpec(
        model="m", model_fingerprint="f", kv_dtype="bfloat16", kv_layout="l", chunk_tokens=256, tp_size=2, pp_size=2
    )
    shards = engine.shards()
    answers = [spec.model_dump_json() for spec in shards]
    assert engine_shards(answers[::-1]) == shards  # workers answer in any order
    other_engine = engine.model_copy(update={"tp_size": 4}).model_dump_json()
    for wrong in (answers[:3], answers + answers[:1], [*answers[:3], other_engine]):
        with pytest.raises(ConfigError, match="expected every pipeline stage and tensor-parallel rank"):
            engine_shards(wrong)
    # KV every tensor-parallel rank holds (MLA) is one shard per stage, which each of the stage's ranks reports
    replicated = engine.model_copy(update={"tp_size": 1}).shards()
    assert engine_shards([spec.model_dump_json() for spec in replicated * 2]) == replicated
