"""Helpers every benchmark shares: percentiles, a rich table, and the JSON results file."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile_ms(samples_s: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples_s) * 1000, q))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    Console(width=200).print(table)


def write_results(name: str, payload: dict) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine it ran on."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    meta = {"machine": platform.node(), "python": platform.python_version(), "unix_time": int(time.time())}
    path.write_text(json.dumps({**payload, "meta": meta}, indent=2) + "\n")
    return path
