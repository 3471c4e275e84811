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
    points += [{"t": 10.040, "event": "finish_load_end"}, {"t": 10.045, "event": "save_end"}]
    points.append({"t": 11.0, "event": "step_begin"})  # after the first token: another request's
    found = budget([out], HIT_PARTS, points)
    parts = found["parts_ms"]
    assert parts["lookup (hashing, index round trip)"] == pytest.approx(3.0)
    assert parts["forward pass (later layers' copy waited for)"] == pytest.approx(14.0)
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
        write(tmp_path / f"pass-{i}", "dram", [0, 1, 10, 20])
        (tmp_path / f"pass-{i}" / "trace-dram").mkdir()
        (tmp_path / f"pass-{i}" / "visible.json").write_text(json.dumps([0.01 * (i + 1)]))
    write(tmp_path / "pass-0", "tax", [0, 1, 2, 10, 11, 20, 21])  # pass 1's tax engine did not finish
    found = collect(tmp_path, repeats=2)
    assert found["vllm"] == [[{"n": 11}, {"n": 21}]] * 2 and len(found["tax"]) == 1
    assert found["dram"] == [([{"n": 10}, {"n": 20}], [])] * 2 and found["nvme"] == []
    assert found["visible_s"] == [0.01, 0.02]
