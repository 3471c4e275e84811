"""Model fingerprints: a digest of the files that decide what KV a model computes.

Hashing every byte of a 100+ GB checkpoint at start-up would add minutes, so the fingerprint covers
the config files in full and, for each weight file, its size plus three 4 MiB samples (start, middle,
end). Any fine-tune or re-quantisation changes bytes in all of them. The result is cached on disk,
keyed by each file's path, size and mtime, so it is computed once per checkpoint, and in the process,
so that fingerprinting a request's LoRA adapter costs a few ``stat`` calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "quantize_config.json",
    "quant_config.json",
    "adapter_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 4 << 20
_CACHE_VERSION = 1
_known: dict[str, str] = {}  # this process's fingerprints, by the same key as the file cache


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixcache" / "fingerprints.json"


def fingerprint_model(model: str, cache_path: Path | None = None) -> str:
    """Fingerprint of a local model directory, or of the name alone when ``model`` is not a directory.

    A name-only fingerprint (``name:<model>``) still separates models by name; pass the local
    snapshot directory whenever there is one so that different weights under one name never mix.
    """
    directory = Path(model)
    if not directory.is_dir():
        return "name:" + model
    files = sorted(
        p for p in directory.iterdir() if p.is_file() and (p.name in CONFIG_FILES or p.suffix in WEIGHT_SUFFIXES)
    )
    if not files:
        return "name:" + model
    stat_key = json.dumps(
        [str(directory.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    )
    if stat_key in _known:
        return _known[stat_key]
    cache_path = cache_path or default_cache_path()
    cache = _load_cache(cache_path)
    cached = cache.get(stat_key)
    if cached:
        _known[stat_key] = cached
        return cached
    combined = xxhash.xxh3_128()
    for path in files:
        digest = _file_digest(path, full=path.name in CONFIG_FILES)
        combined.update(f"{path.name}\x00{path.stat().st_size}\x00{digest}\n".encode())
    fingerprint = combined.hexdigest()
    cache[stat_key] = fingerprint
    _store_cache(cache_path, cache)
    _known[stat_key] = fingerprint
    return fingerprint


def _file_digest(path: Path, full: bool) -> str:
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if full or size <= 3 * SAMPLE_BYTES:
            while block := f.read(8 << 20):
                h.update(block)
        else:
            for offset in (0, size // 2, size - SAMPLE_BYTES):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _load_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _store_cache(path: Path, entries: dict[str, str]) -> None:
    """Best effort: a read-only home only means the fingerprint is recomputed next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": entries}))
        os.replace(tmp, path)
    except OSError:
        pass
