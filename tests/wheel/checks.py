"""The Python halves of tests/wheel/check.sh, one subcommand each; a failed check prints what is wrong, exits 1.

python tests/wheel/checks.py contents REPO WHEEL SDIST   # with any Python
python tests/wheel/checks.py engine-path REPO FRESH_PATH  # with the development venv's Python
python tests/wheel/checks.py installed SITE               # with the fresh venv's Python
python tests/wheel/checks.py modules SITE                 # likewise, the packages alone
"""

from __future__ import annotations

import importlib
import os
import sys
import tarfile
import zipfile
from pathlib import Path

#: The repository's folders that install as prefixcache.<folder> (pyproject.toml's package-dir).
FOLDERS = ("cachestore", "connector", "indexer")
#: What the wheel carries of each folder: its modules and the data files they read at run time.
SHIPPED = ("*.py", "*.lua", "*.c")
COMPILED = (".so", ".pyc", ".pyd")


def shipped_files(repo: Path) -> dict[str, str]:
    """Every file the wheel must hold: its path in the wheel, by its path in the repository."""
    found = {}
    for folder in FOLDERS:
        for pattern in SHIPPED:
            for path in (repo / folder).rglob(pattern):
                relative = path.relative_to(repo / folder)
                if "__pycache__" not in relative.parts:
                    found[f"{folder}/{relative}"] = f"prefixcache/{folder}/{relative}"
    return found


def contents(repo: Path, wheel: Path, sdist: Path) -> list[str]:
    """Problems with what the wheel and the sdist hold: one top-level package, prefixcache, and its dist-info;
    every module and data file of the three folders; nothing compiled (the wheel is for any platform); the sdist
    has the same files, at their repository paths, and the project's metadata."""
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = sorted({name.split("/")[0] for name in names})
    project, version = wheel.name.split("-")[:2]
    problems = []
    if tops != ["prefixcache", f"{project}-{version}.dist-info"]:
        problems.append(f"the wheel's top level is {tops}: want prefixcache and its dist-info alone")
    wanted = shipped_files(repo)
    missing = sorted(inside for inside in wanted.values() if inside not in names)
    if missing:
        problems.append(f"the wheel lacks {len(missing)} files (a package missing from pyproject.toml?): {missing}")
    compiled = sorted(name for name in names if name.endswith(COMPILED))
    if compiled:
        problems.append(f"the wheel carries compiled files, which only build for one platform: {compiled}")
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        held = {name.removeprefix(root + "/") for name in archive.getnames()}
    lacking = sorted(set(wanted) - held) + [name for name in ("pyproject.toml", "README.md") if name not in held]
    if lacking:
        problems.append(f"the sdist lacks {lacking}")
    return problems


def engine_path(repo: Path, fresh_path: Path) -> list[str]:
    """The entries of this Python's path that the fresh venv lacks, but the repository: the development venv's
    site-packages and what its own .pth lines add (vLLM, torch, Mooncake...). Its .pth files themselves do not run
    there, so the editable install's finder, which maps ``prefixcache`` to the repository, stays out."""
    fresh = {os.path.realpath(entry) for entry in fresh_path.read_text().splitlines() if entry}
    skip = fresh | {os.path.realpath(repo)}
    after_this_script = sys.path[1:]  # the first entry is this script's folder
    return [entry for entry in after_this_script if os.path.isdir(entry) and os.path.realpath(entry) not in skip]


def modules(site: Path) -> list[str]:
    """Problems with where this Python imports prefixcache's packages from: the wheel installed in ``site``."""
    site = site.resolve()
    problems = []
    for package in (f"prefixcache.{folder}" for folder in FOLDERS):
        where = Path(importlib.import_module(package).__file__).resolve()
        print(f"{package}: {where}")
        if site not in where.parents:
            problems.append(f"{package} is imported from {where}, not from the wheel in {site}")
    return problems


def installed(site: Path) -> list[str]:
    """Problems with the wheel installed in ``site`` as this Python sees it: its packages, its metadata and its
    vLLM entry point must be the ones found, with no editable install's finder active. (With the repository on the
    path, its checkout's ``prefixcache.egg-info`` would be found first: run this without.)"""
    from importlib.metadata import distribution, entry_points

    site = site.resolve()
    problems = modules(site)
    dist_site = Path(distribution("prefixcache").locate_file("")).resolve()
    if dist_site != site:
        problems.append(f"prefixcache's metadata is read from {dist_site}, not from {site}")
    plugins = [e for e in entry_points(group="vllm.general_plugins") if e.name == "prefixcache"]
    if [Path(e.dist.locate_file("")).resolve() for e in plugins] != [site]:
        problems.append(f"vLLM's plugin entry point is {[(e.value, str(e.dist.locate_file(''))) for e in plugins]}")
    editable = [name for name in sys.modules if name.startswith("__editable__")]
    editable += [entry for entry in sys.path if "__editable__" in entry]
    if editable:
        problems.append(f"an editable install's finder is active: {editable}")
    return problems


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "contents":
        problems = contents(*map(Path, args))
    elif command == "engine-path":
        print("\n".join(engine_path(*map(Path, args))))
        return 0
    elif command == "installed":
        problems = installed(*map(Path, args))
    elif command == "modules":
        problems = modules(*map(Path, args))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for problem in problems:
        print(f"wheel check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
