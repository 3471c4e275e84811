"""vLLM's released wheel, without its dependencies, for the static checks of the connector against a vLLM that is not
installed (tests/test_vllm_api.py): its sources are read from the zip, nothing of it is imported.

    python -m tests.vllm_wheel [VERSION]     (from the repository root; prints the wheel's path)

The wheel (336 MB for 0.33.0) is kept in ``.cache/vllm-wheels/`` (git-ignored; ``PREFIXCACHE_WHEEL_CACHE`` overrides):
``deploy/setup.sh`` fetches it with the dev set-up, so the tests do not reach the network, and a clean machine
downloads it once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The vLLM the CUDA extra supports beside the installed one (pyproject.toml).
NEWEST = "0.33.0"
#: The wheel is the same for every Python from 3.8 (abi3); its platform is named so that any host gets the same one.
PLATFORM = "manylinux_2_28_x86_64"


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIXCACHE_WHEEL_CACHE") or REPO / ".cache" / "vllm-wheels")


def wheel(version: str = NEWEST) -> Path:
    """The path of vLLM ``version``'s wheel, downloaded first if it is not in the cache."""
    directory = cache_dir() / version
    found = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        PLATFORM,
        "-d",
        str(directory),
        f"vllm=={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(directory.glob(f"vllm-{version}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(f"downloading vLLM {version}'s wheel failed ({' '.join(command)}):\n{result.stderr}")
    return found[0]


def source(wheel_path: Path, module_path: str) -> str:
    """The text of ``module_path`` (``vllm/...py``) inside the wheel."""
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.read(module_path).decode()


if __name__ == "__main__":
    print(wheel(*sys.argv[1:2]))
