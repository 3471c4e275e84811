"""The benchmarks' plots, PNGs under docs/images/ drawn from ``benchmarks/results/*.json`` beside the tables
``benchmarks.render`` writes.

A PNG's bytes differ from one matplotlib version to the next, so a plot is not compared by its bytes: each carries,
in its metadata (``SOURCE_KEY``), the sha256 of what it was drawn from (this module's code and its results files),
and a plot is out of date when that differs from what the files give now. Drawing is headless (Agg), at
``DPI``, and stored with a palette of ``COLORS`` colours, for images of a few tens of KB.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, PngImagePlugin

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
IMAGES_DIR = ROOT / "docs" / "images"
SOURCE_KEY = "prefixcache-source-sha256"
DPI = 100
COLORS = 64

Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Plot:
    """``docs/images/<name>.png``, drawn by ``draw`` from the results files ``sources``; ``alt`` is its text in the
    documents."""

    name: str
    sources: tuple[str, ...]
    alt: str
    draw: Callable[[Results], Figure]

    @property
    def file(self) -> str:
        return f"{self.name}.png"


def _figure(width: float = 8, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure  # Agg: a Figure made directly needs no display and no pyplot state

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _ttft(results: Results) -> Figure:
    """Median TTFT by prompt size, one line per system (benchmarks.ttft's medians; the last pass of a row wins,
    as in its table)."""
    ttft = results["ttft"]
    medians: dict[str, dict[int, float]] = {}
    for m in ttft["medians"]:
        medians.setdefault(m["config"], {})[m["tokens"]] = m["ttft_s"]
    fig = _figure()
    ax = fig.subplots()
    for i, (config, by_size) in enumerate(medians.items()):
        sizes = sorted(by_size)
        style = "-" if i < 10 else "--"  # the colour cycle has 10 colours
        ax.plot(sizes, [by_size[s] * 1000 for s in sizes], marker="o", ls=style, label=config)
    ax.set(xlabel="prompt tokens", ylabel="median TTFT, ms (log)", yscale="log", title="Time to first token")
    ax.set_xticks(ttft["sizes"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _serving(results: Results) -> Figure:
    """Mean and p99 TTFT of every row of benchmarks.serving, a pair of bars each."""
    rows = results["serving"]["results"]
    labels = [f"{r['row']} · {r['workload']}" for r in rows]
    fig = _figure(8, 0.25 * len(rows) + 1.2)
    ax = fig.subplots()
    at = range(len(rows))
    ax.barh([i - 0.2 for i in at], [r["mean_ttft_ms"] for r in rows], height=0.4, label="mean")
    ax.barh([i + 0.2 for i in at], [r["p99_ttft_ms"] for r in rows], height=0.4, label="p99")
    ax.set_yticks(list(at), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="TTFT, ms (log)", xscale="log", title="Serving under traffic: TTFT per row")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _index(results: Results) -> Figure:
    """Lookup latency (p50, p99) by indexed chunks, per deployment (benchmarks.index_scale)."""
    latency = results["index_scale"]["latency"]
    fig = _figure()
    ax = fig.subplots()
    for deployment in dict.fromkeys(r["deployment"] for r in latency):
        mine = sorted((r for r in latency if r["deployment"] == deployment), key=lambda r: r["indexed_chunks"])
        chunks = [r["indexed_chunks"] for r in mine]
        (line,) = ax.plot(chunks, [r["p50_ms"] for r in mine], marker="o", label=f"{deployment} p50")
        ax.plot(
            chunks, [r["p99_ms"] for r in mine], marker="s", ls="--", color=line.get_color(), label=f"{deployment} p99"
        )
    ax.set(xlabel="indexed chunks (log)", ylabel="lookup, ms", xscale="log", title="The index: lookup latency")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _node_loss(results: Results) -> Figure:
    """Each request's TTFT against the seconds since node A was lost, a panel per way to lose it, the cold TTFT
    marked (benchmarks.node_loss)."""
    loss = results["node_loss"]
    lost_s = loss["config"]["lost_s"]
    ways = list(loss["ways"])
    fig = _figure(8, 5.5)
    axes = fig.subplots(2, (len(ways) + 1) // 2, sharex=True, sharey=True, squeeze=False).flat
    for ax, way in zip(axes, ways, strict=False):
        for phase, color in (("before", "tab:green"), ("lost", "tab:red"), ("back", "tab:blue")):
            mine = [r for r in loss["requests"] if r["way"] == way and r["phase"] == phase]
            ax.scatter([r["at_s"] for r in mine], [r["ttft_s"] for r in mine], s=8, color=color, label=phase)
        ax.axhline(loss["ways"][way]["cold_ttft_s"], color="gray", ls="--", lw=1, label="cold")
        for at in (0, lost_s):
            ax.axvline(at, color="black", lw=0.5)
        ax.set_title(way, fontsize=9)
        ax.grid(True, alpha=0.3)
    fig.supxlabel("seconds since node A was lost (back at the second line)", fontsize=9)
    fig.supylabel("TTFT, s", fontsize=9)
    axes[0].legend(fontsize=7)
    return fig


PLOTS = [
    Plot("ttft", ("ttft",), "Median TTFT by prompt size, per system", _ttft),
    Plot("serving", ("serving",), "Mean and p99 TTFT of each serving row", _serving),
    Plot("index_latency", ("index_scale",), "Index lookup latency by indexed chunks", _index),
    Plot("node_loss", ("node_loss",), "TTFT of each request since a node was lost, per way to lose it", _node_loss),
]


def source_digest(plot: Plot, results_dir: Path) -> str:
    """The sha256 of what ``plot`` is drawn from: this module's code and its results files' bytes."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for source in plot.sources:
        digest.update((results_dir / f"{source}.json").read_bytes())
    return digest.hexdigest()


def drawn_from(path: Path) -> str | None:
    """The digest a PNG says it was drawn from; None for a missing file or one without it."""
    if not path.exists():
        return None
    with Image.open(path) as image:
        return image.info.get(SOURCE_KEY)


def available(results_dir: Path) -> list[Plot]:
    """The plots whose results files exist."""
    return [p for p in PLOTS if all((results_dir / f"{s}.json").exists() for s in p.sources)]


def stale_images(results_dir: Path, images_dir: Path = IMAGES_DIR) -> list[Plot]:
    return [p for p in available(results_dir) if drawn_from(images_dir / p.file) != source_digest(p, results_dir)]


def draw(plot: Plot, results: Results, results_dir: Path, images_dir: Path = IMAGES_DIR) -> Path:
    """Draw ``plot`` into ``images_dir`` with its source digest in the PNG's metadata."""
    rendered = io.BytesIO()
    plot.draw(results).savefig(rendered, format="png", dpi=DPI)
    info = PngImagePlugin.PngInfo()
    info.add_text(SOURCE_KEY, source_digest(plot, results_dir))
    images_dir.mkdir(parents=True, exist_ok=True)
    path = images_dir / plot.file
    with Image.open(rendered) as image:
        image.convert("RGB").quantize(COLORS).save(path, pnginfo=info, optimize=True)
    return path
