"""The report a warm-up run ends with: one JSON object (``--json``, the daemon's job status) and a table."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, computed_field
from rich.table import Table

from prefixcache.cachestore.warmup.progress import Counters

#: finished: every prompt is done; nothing_to_do: it already was; stopped: --max-prompts reached;
#: incomplete: some prompts' chunks never reached the index (rerun retries them); interrupted: SIGINT/SIGTERM
Outcome = Literal["finished", "nothing_to_do", "stopped", "incomplete", "interrupted"]


class Report(BaseModel):
    job_id: str
    outcome: Outcome
    corpus: str
    model: str
    namespace: str | None
    state_file: str
    counters: Counters
    engine_start_s: float
    compute_s: float
    total_s: float
    problems: list[str]  # the first few bad entries left out, with their places
    problems_total: int

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented form; mypy rejects decorated properties
    @property
    def tokens_per_s(self) -> float:
        return round(self.counters.tokens_computed / self.compute_s, 1) if self.compute_s > 0 else 0.0


def table(report: Report) -> Table:
    c = report.counters
    t = Table(title=f"warm-up {report.job_id}: {report.outcome.replace('_', ' ')}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("prompts", f"{c.prompts_done} of {c.prompts_total} done"),
        ("  warmed now", f"{c.prompts_warmed}"),
        ("  skipped, already cached", f"{c.prompts_cached} ({c.tokens_skipped:,} tokens)"),
        ("  done in earlier runs", f"{c.prompts_done_before}"),
        ("  failed (retried next run)", f"{c.prompts_failed}"),
        ("  invalid (left out)", f"{c.prompts_invalid}"),
        ("tokens computed", f"{c.tokens_computed:,}"),
        ("tokens shared between prompts", f"{c.tokens_reused:,}"),
        ("chunks added", f"{c.chunks_added}"),
        ("bytes added", f"{c.bytes_added:,} ({c.bytes_added / (1 << 20):,.1f} MiB)"),
        ("tokens/s", f"{report.tokens_per_s:,.0f}"),
        (
            "time",
            f"{report.total_s:.1f} s (engine start {report.engine_start_s:.1f} s, compute {report.compute_s:.1f} s)",
        ),
    ]
    for name, value in rows:
        t.add_row(name, value)
    return t
