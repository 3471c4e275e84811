"""Helpers every benchmark shares: percentiles, a rich table, the JSON results file, and LMCache's peer server."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from prefixcache.cachestore.host.processes import ManagedProcess, free_port, port_open
from prefixcache.indexer.chunking import PROBE_TOKENS
from tests.e2e.launch import vllm_env

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


def with_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, *, apart_from: Iterable[str] = ()) -> bool:
    """Whether every flag but those named in ``apart_from`` kept its default: only such a run is the full run
    that the README quotes; any other (a few rows, other sizes, fewer repeats) is partial."""
    defaults, excepted = vars(parser.parse_args([])), set(apart_from)
    return all(getattr(args, name) == value for name, value in defaults.items() if name not in excepted)


def write_results(name: str, payload: dict, *, partial: bool = False) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine it ran on.

    A ``partial`` run (see ``with_defaults``; some rows or sizes only, as when checking one change) goes to
    ``<name>.partial.json`` instead, which git ignores: it must not overwrite the full run that the README quotes.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / (f"{name}.partial.json" if partial else f"{name}.json")
    meta = {"machine": platform.node(), "python": platform.python_version(), "unix_time": int(time.time())}
    path.write_text(json.dumps({**payload, "meta": meta}, indent=2) + "\n")
    return path


def wait_until_persisted(url: str, prompts: list[list[int]], timeout_s: float = 300) -> None:
    """Every chunk of ``prompts`` a producer published reached the NVMe tier (write-behind), so a daemon restart
    loses none."""
    chunk = httpx.get(url + "/v1/config").json()["chunk_tokens"]
    # full chunks, plus the tail where it is long enough to be published (connector/plans.py)
    expected = sum(len(p) // chunk + (len(p) % chunk >= PROBE_TOKENS) for p in prompts)
    from prefixcache.cachestore.cli.admin import (
        Api,  # the admin token as the CLI finds it (given, or the daemon's own file)
    )

    headers = Api(url, os.environ.get("PREFIXCACHE_ADMIN_TOKEN")).headers
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(url + "/v1/stats", headers=headers).json()["write_behind"]["persisted"] >= expected:
            return
        time.sleep(0.5)
    raise RuntimeError(f"write-behind persisted fewer than {expected} chunks in {timeout_s} s")


@contextmanager
def bound_to(cpus: frozenset[int] | None) -> Iterator[None]:
    """Servers started inside run on ``cpus`` (None: anywhere): they inherit this thread's binding."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def lmcache_mp_server(workdir: Path, cpus: frozenset[int] | None) -> Iterator[dict]:
    """LMCache's multi-process server (2 GB of L1, LRU, 256-token chunks), started on ``cpus`` with the engines'
    environment and its log in ``workdir``; yields the ``kv_transfer_config`` of ``LMCacheMPConnector`` for it, and
    stops it on exit. ``make bench`` installs lmcache."""
    port, http_port = free_port(), free_port()
    server = ManagedProcess(
        "lmcache server",
        [
            sys.executable,
            "-m",
            "lmcache.v1.multiprocess.http_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "LRU",
            "--chunk-size",
            "256",
            "--disable-observability",
            "--supported-transfer-mode",
            "auto",
        ],
        workdir / "lmcache-server.log",
        lambda: port_open("127.0.0.1", port),
        env=vllm_env(),
    )
    with bound_to(cpus):
        server.start(timeout_s=120)
    try:
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
        yield {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    finally:
        server.stop(grace_s=30)
