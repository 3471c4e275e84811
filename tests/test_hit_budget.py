"""The connector's trace points (cachestore/client/trace.py) and how benchmarks/hit_budget.py adds a hit's parts up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.hit_budget import HIT_PARTS, VLLM_PARTS, budget, read_trace, tpot_ms
from prefixcache.cachestore.client import trace


def test_trace_off_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "ON", False)
    monkeypatch.setattr(trace, "_DIR", tmp_path)
    trace.mark("lookup_start", "r1")
    trace.mark_all("scheduled", ["r1"])
    assert list(tmp_path.iterdir()) == []


def test_trace_on_writes_a_line_per_point_in_a_file_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace, "ON", True)
    monkeypatch.setattr(trace, "_DIR", tmp_path)
    monkeypatch.setattr(trace, "_out", None)
    trace.mark("lookup_start", "r1")
    trace.mark_all("scheduled", ["r1", "r2"], loads=["r1"])
    trace._out.close()  # type: ignore[union-attr]
    monkeypatch.setattr(trace, "_out", None)
    points = read_trace(tmp_path)
    assert [p["event"] for p in points] == ["lookup_start", "scheduled", "scheduled"]
    assert [p["req"] for p in points] == ["r1", "r1", "r2"] and points[1]["loads"] == ["r1"]
    assert (tmp_path / f"trace-{os.getpid()}.jsonl").exists()


def _output(queued: float, first: float, ttft_s: float, last: float = 0.0, tokens: int = 1) -> dict:
    ts = {"queued_ts": queued, "scheduled_ts": queued + 0.001, "first_token_ts": first, "last_token_ts": last}
    return {"engine_ts": ts, "ttft_s": ttft_s, "token_ids": [0] * tokens}


def test_a_hits_parts_add_up_to_its_ttft() -> None:
    out = _output(10.000, 10.050, 0.056)
    names = ["lookup_start", "lookup_end", "scheduled", "step_begin", "read_end", "forward_start", "forward_end"]
    times = [10.001, 10.004, 10.006, 10.007, 10.015, 10.016, 10.030]
    points = [{"t": t, "event": e, "req": None} for t, e in zip(times, names, strict=True)]
    points += [{"t": 10.020, "event": "later_layers_wait"}, {"t": 10.0235, "event": "later_layers_in"}]
    points += [{"t": 10.040, "event": "finish_load_end"}, {"t": 10.045, "event": "save_end"}]
    points.append({"t": 11.0, "event": "step_begin"})  # after the first token: another request's
    found = budget([out], HIT_PARTS, points)
    parts = found["parts_ms"]
    assert parts["lookup (hashing, index round trip)"] == pytest.approx(3.0)
    assert parts["forward pass (later layers' copy waited for)"] == pytest.approx(14.0)
    assert found["later_layers_waited_ms"] == pytest.approx(3.5)  # inside the forward pass
    assert found["worker_steps"] == 1
    assert sum(parts.values()) == pytest.approx(found["ttft_ms"])


def test_vllm_parts_and_tpot() -> None:
    outs = [
        _output(1.0, 1.02, 0.025, last=1.02 + 0.31, tokens=32),
        _output(2.0, 2.03, 0.035, last=2.03 + 0.62, tokens=32),
    ]
    found = budget(outs, VLLM_PARTS, [])
    assert found["ttft_ms"] == pytest.approx(30.0)
    assert found["parts_ms"]["front end (arrival -> queued, token out)"] == pytest.approx(5.0)
    assert tpot_ms(outs) == pytest.approx(15.0)
    json.dumps(found)  # written as is


def test_collect_reads_each_passes_measured_outputs_and_leaves_out_unfinished_engines(tmp_path: Path) -> None:
    from benchmarks.hit_budget import collect

    def write(folder: Path, engine: str, outputs: list[int]) -> None:
        folder.mkdir(exist_ok=True)
        (folder / f"{engine}.out.json").write_text(json.dumps({"outputs": [{"n": n} for n in outputs]}))

    for i in range(2):
        write(tmp_path / f"pass-{i}", "vllm", [0, 1, 2, 10, 11, 20, 21])  # warm-ups, then two prompts twice each
        write(tmp_path / f"pass-{i}", "dram", [0, 1, 2, 10, 11, 20, 21])  # DRAM hits, then vLLM's own
        (tmp_path / f"pass-{i}" / "trace-dram").mkdir()
    write(tmp_path / "pass-0", "producer", [0, 1, 10, 20])
    (tmp_path / "pass-0" / "trace-producer").mkdir()
    (tmp_path / "pass-0" / "found.json").write_text(json.dumps([5.0, 6.0]))
    write(tmp_path / "pass-0", "tax", [0, 1, 2, 10, 11, 20, 21])  # pass 1's tax engine did not finish
    write(tmp_path / "pass-1", "beside", [0, 1, 2, 3, 10, 11, 12, 20, 21, 22])  # thrice each
    found = collect(tmp_path, repeats=2)
    assert found["vllm"] == [[{"n": 11}, {"n": 21}]] * 2 and len(found["tax"]) == 1
    assert found["dram"] == [([{"n": 10}, {"n": 20}], [])] * 2 and found["nvme"] == []
    assert found["same_engine"] == [([{"n": 11}, {"n": 21}], [])] * 2
    assert found["beside"] == [{"n": n} for n in (10, 11, 12, 20, 21, 22)]
    assert found["produced"] == [({"n": 10}, 5.0), ({"n": 20}, 6.0)]


def test_publish_to_visible_runs_from_the_requests_end_through_its_last_publish() -> None:
    from benchmarks.hit_budget import PUBLISH_PARTS, publish_budget

    def output(queued: float, returned: float) -> dict:
        return {"engine_ts": {"queued_ts": queued}, "returned_ts": returned}

    events = ["save_end", "signing_end", "publish_start", "publish_signed", "publish_stored", "publish_registered"]
    first = [1.010, 1.0105, 1.011, 1.015, 1.020, 1.021]  # an earlier step's publish of the same request
    last = [1.050, 1.053, 1.054, 1.0545, 1.066, 1.068]
    trace = [{"t": t, "event": e} for t, e in zip(first + last, events * 2, strict=True)]
    trace += [{"t": 2.030, "event": "publish_start"}]  # the next request's
    found = publish_budget([(output(1.0, 1.060), 1.070), (output(2.0, 2.040), 2.035)], trace)
    parts = found["parts_ms"]
    assert parts["forward over -> signed (the layers left to sign)"] == pytest.approx(3.0)
    assert parts["signed -> publish starts (queue)"] == pytest.approx(1.0)
    assert parts["store into DRAM (Mooncake put)"] == pytest.approx(11.5)
    assert parts["registered -> found by a lookup (index poll)"] == pytest.approx(2.0)
    assert set(parts) == {name for name, _, _ in PUBLISH_PARTS}  # the second request's publish is unfinished
    assert found["samples"] == 2  # 10 ms after the first request returned; the second was visible before it did
    assert found["p50"] == pytest.approx(5.0) and found["p99"] == pytest.approx(9.9)


def test_timed_hooks_add_up_per_process_until_a_steps_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "HOOKS", True)
    monkeypatch.setattr(trace, "_DIR", tmp_path)
    monkeypatch.setattr(trace, "_out", None)

    @trace.timed
    def hook(x: int) -> int:
        return x + 1

    @trace.timed_step_end
    def step_end() -> None:
        pass

    assert hook(1) == 2 and hook(2) == 3 and hook.__name__ == "hook"
    trace.mark("lookup_start")  # points are not written while hooks are timed
    step_end()
    trace._out.close()  # type: ignore[union-attr]
    monkeypatch.setattr(trace, "_out", None)
    (point,) = read_trace(tmp_path)
    assert point["event"] == "timed" and set(point["timed"]) == {"hook", "step_end"} and point["timed"]["hook"] > 0


def test_timed_is_the_hook_itself_unless_hooks_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "HOOKS", False)

    def hook() -> None:
        pass

    assert trace.timed(hook) is hook and trace.timed_step_end(hook) is hook


def test_an_unknown_trace_mode_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, trace.TRACE_DIR_ENV: str(tmp_path), trace.TRACE_WHAT_ENV: "everything"}
    code = "import prefixcache.cachestore.client.trace"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert run.returncode != 0 and "PREFIXCACHE_TRACE_WHAT must be 'points' or 'hooks'" in run.stderr


def test_connector_time_per_decode_step_and_in_the_first_token() -> None:
    from benchmarks.hit_budget import connector_time

    out = _output(1.0, 1.020, 0.025, last=1.020 + 0.300, tokens=31)  # 30 decode steps of 10 ms
    points = [{"t": 1.010, "event": "timed", "timed": {"get_num_new_matched_tokens": 0.001}}]
    points += [{"t": 1.020 + 0.01 * i, "event": "timed", "timed": {"wait_for_save": 0.0001}} for i in range(1, 31)]
    points.append({"t": 2.0, "event": "timed", "timed": {"wait_for_save": 1.0}})  # after the request
    found = connector_time([out], points)
    assert found["per_decode_step_ms"] == pytest.approx(0.1)
    assert found["share_of_decode_step"] == pytest.approx(0.01)
    assert found["in_own_hit_ms"] == pytest.approx(1.0) and found["share_of_own_hit"] == pytest.approx(0.04)
    assert found["per_decode_step_by_hook_ms"] == {"wait_for_save": pytest.approx(0.1)}


def test_the_floor_adds_the_round_trip_and_one_move_of_the_hits_kv() -> None:
    from benchmarks.hit_budget import floor
    from tests.e2e.tinymodel import KV_BYTES_PER_TOKEN

    found = floor(256, own_hit_ms=10.0, lookup_ms=0.5, rounds=3)
    assert found["kv_mib"] == 256 * KV_BYTES_PER_TOKEN / 2**20
    assert found["copy_ms"] > 0 and found["mac_ms"] > 0 and found["nvme_read_ms"] > 0
    assert found["dram_ratio"] == pytest.approx((max(10.0, found["copy_ms"]) + 0.5) / 10.0)
    assert found["nvme_ratio"] == pytest.approx((max(10.0, found["nvme_read_ms"]) + 0.5) / 10.0)


def test_contended_compares_the_beside_engines_hits_alone_and_with_the_bystander() -> None:
    from benchmarks.hit_budget import contended

    # a prompt computed, then hit alone and with the bystander beside it (either order)
    runs = [
        {"ttft_s": 0.5},
        {"ttft_s": 0.030},
        {"ttft_s": 0.036, "bystander_s": 0.010},
        {"ttft_s": 0.5},
        {"ttft_s": 0.038, "bystander_s": 0.012},
        {"ttft_s": 0.032},
    ]
    found = contended(runs, lookup_ms=0.5, copy_ms=8.0)
    assert found["alone_ms"] == pytest.approx(31.0) and found["beside_ms"] == pytest.approx(37.0)
    assert found["ratio"] == pytest.approx(37.0 / 31.0) and found["work_ms"] == pytest.approx(11.0)
    assert found["samples"] == 2
    from tests.e2e.tinymodel import LAYERS

    assert found["dram_ratio"] == pytest.approx((37.0 + 0.5 + 8.0 / LAYERS) / 31.0)


def test_the_bystander_copies_all_but_the_first_layer_and_macs_the_whole_kv() -> None:
    from benchmarks.hit_budget import bystander_work
    from tests.e2e.tinymodel import BLOCK_TOKENS, KV_BYTES_PER_TOKEN, LAYERS

    work = bystander_work(4097, frozenset({1}))
    kv = 4096 * KV_BYTES_PER_TOKEN  # the cached blocks: 4096 of the 4097 tokens
    assert 4096 % BLOCK_TOKENS == 0
    assert work == {"copy_bytes": kv - kv // LAYERS, "mac_bytes": kv, "cpus": [1]}


def test_the_bystander_process_works_once_per_command_where_it_is_bound() -> None:
    from tests.e2e.bystander import Bystander

    cpu = min(os.sched_getaffinity(0))
    bystander = Bystander(1 << 20, 2 << 20, [cpu])
    try:
        took = []
        for _ in range(2):
            bystander.start()
            took.append(bystander.wait())
        assert all(0 < seconds < 10 for seconds in took)
    finally:
        bystander.close()
    assert bystander.returncode == 0


def test_a_traced_budget_joins_engines_outputs_and_traces() -> None:
    from benchmarks.hit_budget import traced_budget

    first, second = _output(10.000, 10.050, 0.056), _output(20.000, 20.040, 0.046)
    first["num_cached_tokens"], second["num_cached_tokens"] = 4096, 3968
    lookups = [
        [{"t": 10.001, "event": "lookup_start"}, {"t": 10.004, "event": "lookup_end"}],
        [{"t": 20.001, "event": "lookup_start"}, {"t": 20.006, "event": "lookup_end"}],
    ]
    found = traced_budget([([second], lookups[1]), ([first], lookups[0])])
    assert found["parts_ms"]["lookup (hashing, index round trip)"] == pytest.approx(4.0)  # median of 3 and 5
    assert found["cached_tokens"] == 3968
