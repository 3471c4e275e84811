"""The package's layering, read from its source (docs/development.md, "Layering").

Imports are parsed with ``ast``: nothing of the package is imported here, except by the two tests that run a
fresh interpreter to see what an import really loads. A dependency is any import (at module level or inside a
function) but those under ``if TYPE_CHECKING:``, and import circles count both: a function that imports a module
importing its own is a circle that only hides until the function runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The folders that install as ``prefixcache.<folder>`` (pyproject.toml's ``package-dir``).
FOLDERS = ("cachestore", "connector", "indexer")

#: Each layer, and what its modules may import of the package besides their own layer. Names are relative to
#: ``prefixcache``; a name stands for a module and everything under it. A module belongs to the longest layer
#: that names it or a package above it, so ``cachestore.api.models`` is a layer of its own inside
#: ``cachestore.api``.
LAYERS: dict[str, set[str]] = {
    # tokens -> keys, namespaces, the index protocol and its Redis backend: knows nothing of how bytes are stored
    # (and the package's errors, background threads and log limits, which every layer uses)
    "indexer": set(),
    # the machine: CPU sets, child processes and their priority, listeners, secret files
    "cachestore.host": {"indexer"},
    # one chunk as bytes: codec, MAC, arena
    "cachestore.chunks": {"cachestore.host", "indexer"},
    # where bytes live: the Mooncake DRAM pool, the NVMe tier, the Mooncake servers
    "cachestore.tiers": {"cachestore.chunks", "cachestore.host", "indexer"},
    # the library connectors and warm-up jobs attach with: no REST API, no daemon services
    "cachestore.client": {"cachestore.tiers", "cachestore.chunks", "cachestore.host", "indexer"},
    # the daemon's background services, and what its admin API does (independent of HTTP)
    "cachestore.services": {
        "cachestore.api.models",  # the admin API's bodies and answers are the admin service's arguments and results
        "cachestore.client",
        "cachestore.tiers",
        "cachestore.chunks",
        "cachestore.host",
        "indexer",
    },
    # the daemon's settings: read by the REST API and warm-up jobs, which the daemon starts
    "cachestore.node.settings": {"cachestore.host", "indexer"},
    # warm-up jobs: a vLLM engine with the connector, run by the CLI or the daemon
    "cachestore.warmup": {"cachestore.client", "cachestore.node.settings", "cachestore.host", "indexer"},
    # the disaggregated-prefill proxy: a client of the index, in front of vLLM engines
    "cachestore.proxy": {"cachestore.client", "cachestore.host", "indexer"},
    # the admin API's bodies and answers (pydantic only): the API, the admin service and the CLI share them
    "cachestore.api.models": {"indexer"},
    # the daemon's REST API (FastAPI)
    "cachestore.api": {
        "cachestore.services",
        "cachestore.warmup",
        "cachestore.node.settings",
        "cachestore.client",
        "cachestore.chunks",
        "cachestore.host",
        "indexer",
    },
    # the daemon: starts the servers and services and serves the API
    "cachestore.node": {
        "cachestore.api",
        "cachestore.services",
        "cachestore.warmup",
        "cachestore.client",
        "cachestore.tiers",
        "cachestore.chunks",
        "cachestore.host",
        "indexer",
    },
    # the ``prefixcache`` command: anything of the cache store
    "cachestore.cli": {
        "cachestore.node",
        "cachestore.proxy",
        "cachestore.api",
        "cachestore.warmup",
        "cachestore.client",
        "cachestore.host",
        "indexer",
    },
    # ``python -m prefixcache.cachestore``
    "cachestore": {"cachestore.cli"},
    # vLLM's KV connector: reaches the store through the client only. Of the indexer, the pure modules (no
    # Redis: that is the client's); of the tiers, the DRAM copy's layout and the O_DIRECT reads of this node's
    # pack files, which it makes into vLLM's pages itself.
    "connector": {
        "cachestore.client",
        "cachestore.chunks",
        "cachestore.tiers.dram",
        "cachestore.tiers.nvme_io",
        "cachestore.host.cpus",
        "indexer.chunking",
        "indexer.errors",
        "indexer.fingerprint",
        "indexer.index",
        "indexer.keys",
        "indexer.namespace",
        "indexer.tokens",
    },
}

#: Imports the layers above forbid, each with the work that removes it: the test fails once it is gone, so
#: that it leaves this list too.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Third-party packages a layer never imports directly: the connector reaches Redis, Mooncake and RocksDB only
#: through the client.
NEVER_IMPORTED: dict[str, set[str]] = {
    "connector": {"redis", "mooncake", "rocksdict"},
}

#: What the client library must not pull in, directly or through any module it imports: the daemon's parts
#: and the web stack they run on.
CLIENT = "cachestore.client"
NOT_UNDER_CLIENT = (
    "cachestore.api",
    "cachestore.services",
    "cachestore.node",
    "cachestore.cli",
    "cachestore.proxy",
    "cachestore.warmup",
)
WEB_STACK = ("fastapi", "uvicorn", "starlette")


@dataclass(frozen=True)
class Import:
    importer: str  # module names without the "prefixcache." in front, for package modules
    target: str  # the module imported: a package module (relative name) or a third-party one (full name)
    name: str | None  # the name a ``from`` import takes from ``target``, when that is no module of the package
    line: int
    module_level: bool  # not inside a function

    @property
    def internal(self) -> bool:
        return self.target in modules()

    def __str__(self) -> str:
        taken = f" ({self.name})" if self.name else ""
        return f"{self.importer}:{self.line} imports {self.target}{taken}"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by relative name (``cachestore.client.cache_client``; a package by its own)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    nodes: Iterable[ast.AST], in_function: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement and whether it is inside a function, skipping those under ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, in_function)
        else:
            inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _import_nodes(ast.iter_child_nodes(node), inside)


def _relative(name: str) -> str:
    """A package module's name without the ``prefixcache.`` in front; any other name as it is."""
    return name.removeprefix("prefixcache.")


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node, in_function in _import_nodes(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, _relative(alias.name), None, node.lineno, not in_function))
            continue
        if node.level:  # relative: from the importer's package up
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = _relative(node.module or "")
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in modules():
                found.append(Import(module, submodule, None, node.lineno, not in_function))
            else:
                found.append(Import(module, source, alias.name, node.lineno, not in_function))
    return tuple(found)


def all_imports() -> Iterator[Import]:
    for module in modules():
        yield from imports_of(module)


def layer_of(module: str) -> str:
    """The longest layer that names ``module`` or a package above it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (name := ".".join(parts[:end])) in LAYERS:
            return name
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _within(module: str, names: Iterable[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def test_every_module_belongs_to_a_layer_and_every_layer_names_real_modules():
    for module in modules():
        layer_of(module)
    named = set(LAYERS) | {name for allowed in LAYERS.values() for name in allowed}
    missing = sorted(name for name in named if not any(_within(m, [name]) for m in modules()))
    assert not missing, f"layers name modules that do not exist: {missing}"


def test_each_layer_imports_only_the_layers_it_may():
    wrong = {}
    for imp in all_imports():
        if not imp.internal:
            continue
        layer = layer_of(imp.importer)
        # a layer holds the layers inside it (cachestore.api holds cachestore.api.models)
        if _within(layer_of(imp.target), [layer]) or _within(imp.target, LAYERS[layer]):
            continue
        if (imp.importer, imp.target) not in KNOWN_EXCEPTIONS:
            wrong[f"{imp.importer}:{imp.line} imports {imp.target}"] = (
                f"layer {layer} may import {sorted(LAYERS[layer])}"
            )
    assert not wrong, "imports the layering forbids:\n" + "\n".join(f"{imp} [{why}]" for imp, why in wrong.items())


def test_known_exceptions_still_exist():
    edges = {(imp.importer, imp.target) for imp in all_imports()}
    gone = [f"{a} -> {b} ({why})" for (a, b), why in KNOWN_EXCEPTIONS.items() if (a, b) not in edges]
    assert not gone, "no longer imported: remove them from KNOWN_EXCEPTIONS:\n" + "\n".join(gone)


def test_layers_never_import_the_third_party_packages_they_must_not():
    wrong = [
        str(imp)
        for imp in all_imports()
        for layer, packages in NEVER_IMPORTED.items()
        if _within(imp.importer, [layer]) and not imp.internal and imp.target.split(".")[0] in packages
    ]
    assert not wrong, "\n".join(wrong)


def _closure(start: Iterable[str]) -> dict[str, Import | None]:
    """Every package module the ``start`` modules import, directly or not, with the import that first reached
    it (None for a start module). A module's import also runs the packages above it."""
    reached: dict[str, Import | None] = dict.fromkeys(start)
    todo = list(reached)
    while todo:
        for imp in imports_of(todo.pop()):
            if not imp.internal:
                continue
            parts = imp.target.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
                if target in modules() and target not in reached:
                    reached[target] = imp
                    todo.append(target)
    return reached


def _chain(reached: dict[str, Import | None], module: str) -> str:
    """How ``module`` was reached: the imports from a start module to it."""
    steps = [module]
    while (imp := reached[module]) is not None:
        module = imp.importer
        steps.append(f"{module}:{imp.line}")
    return " <- ".join(steps)


def test_the_client_never_reaches_the_daemon_or_the_web_stack():
    reached = _closure(m for m in modules() if _within(m, [CLIENT]))
    wrong = [_chain(reached, m) for m in reached if _within(m, NOT_UNDER_CLIENT)]
    web = {(m, imp.target.split(".")[0]) for m in reached for imp in imports_of(m) if not imp.internal}
    wrong += [f"{package} <- {_chain(reached, m)}" for m, package in sorted(web) if package in WEB_STACK]
    assert not wrong, "the client library reaches:\n" + "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its modules in order, the first again at the end), or None."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path.pop())
            elif nxt in path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_circles():
    """Function-level imports included (``import_graph``)."""
    circle = _cycle(import_graph())
    assert circle is None, "modules import each other: " + " -> ".join(circle or [])


def import_graph(module_level_only: bool = False) -> dict[str, set[str]]:
    """Each module and the package modules it imports, at module level only or also inside its functions."""
    return {
        m: {imp.target for imp in imports_of(m) if imp.internal and (imp.module_level or not module_level_only)} - {m}
        for m in modules()
    }


def test_function_level_imports_count_as_circles():
    """An import inside a function makes a circle as surely as one at the top (cachestore.cli.app's help used to
    come from the settings page's generator, which imported the app inside a function)."""
    graph = import_graph()
    inner = [imp for m in modules() for imp in imports_of(m) if imp.internal and not imp.module_level]
    assert inner, "no function-level import found: the parser no longer sees them"
    assert all(imp.target in graph[imp.importer] for imp in inner)


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_private_name_is_imported_across_modules():
    wrong = [
        str(imp)
        for imp in all_imports()
        if imp.internal and imp.name and imp.name.startswith("_") and not imp.name.startswith("__")
    ]
    assert not wrong, "private names imported from other modules (make them public, or move them):\n" + "\n".join(wrong)


def test_packages_import_none_of_their_modules():
    """Importing one module of a package then loads only what that module imports, not its siblings."""
    wrong = [
        str(imp)
        for module, path in modules().items()
        if path.name == "__init__.py"
        for imp in imports_of(module)
        if imp.internal and imp.module_level
    ]
    assert not wrong, "\n".join(wrong)


def _python_files() -> Iterator[Path]:
    for top in (*FOLDERS, "tests", "benchmarks", "deploy", "devtools"):
        yield from (ROOT / top).rglob("*.py")


def test_the_package_is_imported_by_its_installed_name_only():
    wrong = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FOLDERS
            ]
    assert not wrong, "import prefixcache.<folder>, not the folder itself:\n" + "\n".join(wrong)


def test_pyproject_lists_every_package_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "prefixcache." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted(folders)
    assert setuptools["package-dir"] == {f"prefixcache.{folder}": folder for folder in FOLDERS}


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    script = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_importing_the_client_loads_no_web_stack_and_no_daemon():
    loaded = _loaded_after("import prefixcache.cachestore.client.cache_client")
    assert not {m for m in loaded if m.split(".")[0] in WEB_STACK}
    assert not {m for m in loaded if _within(_relative(m), NOT_UNDER_CLIENT)}


@pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM")
def test_importing_the_connector_loads_no_daemon():
    """vLLM itself imports FastAPI, so what is checked is the daemon's parts: the connector reaches none of them."""
    sides = "prefixcache.connector.plugin, prefixcache.connector.scheduler_side, prefixcache.connector.worker_side"
    loaded = _loaded_after(f"import {sides}")
    assert "prefixcache.connector.worker_side" in loaded
    assert not sorted(m for m in loaded if _within(_relative(m), NOT_UNDER_CLIENT))
