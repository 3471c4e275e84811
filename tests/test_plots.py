"""The benchmarks' plots are checked by the digest of their sources they carry, not by their bytes (which differ
between matplotlib versions), and a document showing an image that does not exist is out of date."""

from __future__ import annotations

import shutil
from pathlib import Path

from PIL import Image, PngImagePlugin

from benchmarks.plots import PLOTS, SOURCE_KEY, draw, drawn_from, stale_images
from benchmarks.render import RESULTS_DIR, ROOT, load, missing_images

(NODE_LOSS,) = [p for p in PLOTS if p.name == "node_loss"]


def _results_with_node_loss(tmp_path: Path) -> Path:
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    shutil.copy(RESULTS_DIR / "node_loss.json", results_dir)
    return results_dir


def test_a_plot_is_current_until_its_results_change_whatever_its_bytes(tmp_path):
    results_dir, images = _results_with_node_loss(tmp_path), tmp_path / "images"
    assert stale_images(results_dir, images) == [NODE_LOSS]  # not drawn yet
    path = draw(NODE_LOSS, load(results_dir), results_dir, images)
    assert 5_000 < path.stat().st_size < 60_000
    assert stale_images(results_dir, images) == []
    with Image.open(path) as image:  # the same plot encoded otherwise, as another matplotlib would
        info = PngImagePlugin.PngInfo()
        info.add_text(SOURCE_KEY, image.info[SOURCE_KEY])
        image.convert("RGB").save(path, pnginfo=info, compress_level=1)
    assert stale_images(results_dir, images) == []
    source = results_dir / "node_loss.json"
    source.write_text(source.read_text().replace('"ttft_s": 0.1', '"ttft_s": 0.2', 1))
    assert stale_images(results_dir, images) == [NODE_LOSS]
    assert drawn_from(tmp_path / "none.png") is None


def test_an_image_a_document_shows_must_exist(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("![a plot](images/there.png) ![gone](images/gone.png) ![far](https://example.com/x.png)\n")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "there.png").write_bytes(b"")
    assert missing_images(doc) == ["images/gone.png"]


def test_the_documents_show_every_plot():
    shown = (ROOT / "docs" / "benchmarks.md").read_text()
    assert all(f"](images/{p.file})" in shown for p in PLOTS)
    assert "](docs/images/ttft.png)" in (ROOT / "README.md").read_text()
