"""The vLLM engine of a warm-up run: offline ``LLM``, PrefixCacheConnector as ``kv_producer``, ``max_tokens=1``.

Engine options are parsed by vLLM's own parser (the one behind ``vllm serve``), so a warm-up is set
up exactly like the server it warms: a different model name, dtype, KV dtype or block size would
put the chunks in a namespace the server never looks in. vLLM's own prefix cache is on unless the
options turn it off: prompts sharing a prefix then compute it once (see ``plan``).

The namespace for skip lookups is the one the connector derived inside the worker, asked through a
worker extension: deriving it again here could drift from the namespace the chunks are stored in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from prefixcache.cachestore.warmup.corpus import ModelLimits
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.namespace import NamespaceSpec

WORKER_EXTENSION = "prefixcache.cachestore.warmup.worker_extension.PrefixCacheWorkerExtension"
#: Engine options the warm-up sets itself: the model through its own flags, the connector always.
_OWN_OPTIONS = {
    "model": "pass the model with --model",
    "tokenizer": "pass the tokenizer with --tokenizer",
    "kv_transfer_config": "the warm-up configures PrefixCacheConnector itself",
    "worker_extension_cls": "the warm-up sets its own worker extension",
}


@dataclass(frozen=True)
class ConnectorOptions:
    service_url: str
    arena_mb: int | None = None
    redis_password: str | None = None

    def kv_transfer_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"service_url": self.service_url}
        if self.arena_mb is not None:
            extra["arena_mb"] = self.arena_mb
        if self.redis_password:
            extra["redis_password"] = self.redis_password
        return {
            "kv_connector": "PrefixCacheConnector",
            "kv_connector_module_path": "prefixcache.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        }


def engine_args(model: str, tokenizer: str | None, options: Sequence[str], connector: ConnectorOptions) -> Any:
    """vLLM ``EngineArgs`` from ``vllm serve``-style options plus the warm-up's own settings."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(f"invalid vLLM engine option: {message}")

    # vLLM's FlexibleArgumentParser.__init__ is unannotated
    parser = EngineArgs.add_cli_args(Parser(prog="prefixcache warmup", add_help=False))  # type: ignore[no-untyped-call]
    defaults, given = parser.parse_args([]), parser.parse_args(list(options))
    for dest, why in _OWN_OPTIONS.items():
        if getattr(given, dest) != getattr(defaults, dest):
            raise ConfigError(f"engine option --{dest.replace('_', '-')} is not accepted here: {why}")
    given.model, given.tokenizer, given.worker_extension_cls = model, tokenizer, WORKER_EXTENSION
    given.kv_transfer_config = _kv_transfer_config(connector)
    if given.enable_prefix_caching is None:
        given.enable_prefix_caching = True
    return EngineArgs.from_cli_args(given)  # set before: building EngineArgs resolves the model


def _kv_transfer_config(connector: ConnectorOptions) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**connector.kv_transfer_config())


def engine_shards(answers: Sequence[str]) -> list[NamespaceSpec]:
    """The namespaces the workers reported (JSON, one per worker, in any order), in ``NamespaceSpec.shard`` order;
    refused unless they are every shard of one engine, each reported by as many workers as the others: once, or
    by every tensor-parallel rank where those ranks hold the same KV (connector/settings.py, ``namespace_for``)."""
    reported = Counter(NamespaceSpec.model_validate_json(a) for a in answers)
    specs = sorted(reported, key=lambda spec: spec.shard)
    if not specs or specs != specs[0].shards() or len(set(reported.values())) != 1:
        raise ConfigError(
            f"workers report namespaces of shards {sorted(spec.shard for spec in reported.elements())}: "
            "expected every pipeline stage and tensor-parallel rank, as often as each other"
        )
    return specs


class WarmupEngine:
    """One offline engine for the whole run; ``close`` drains the connector's publishing before it returns."""

    def __init__(self, args: Any) -> None:
        from vllm import LLM

        self.llm = LLM.from_engine_args(args)

    def namespaces(self) -> list[NamespaceSpec]:
        """The namespace of each rank (pipeline stage and tensor-parallel rank), in ``NamespaceSpec.shard`` order:
        each stores its shard of the pages there."""
        return engine_shards(self.llm.collective_rpc("prefixcache_namespace"))

    def limits(self) -> ModelLimits:
        tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        max_id = max(tokenizer.max_token_id, model_config.get_vocab_size() - 1)
        return ModelLimits(max_token_id=max_id, max_model_len=model_config.max_model_len)

    def encode(self, text: str) -> list[int]:
        """Token ids as vLLM makes them for a completion request's text prompt."""
        return list(self.llm.get_tokenizer().encode(text, add_special_tokens=True))

    def prefill(self, prompts: Sequence[tuple[list[int], str | None]]) -> list[int]:
        """Run each (token ids, tenant salt) to its first output token; returns vLLM's local prefix-cache hits."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        requests: list[Any] = [
            {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})} for ids, salt in prompts
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [int(out.num_cached_tokens or 0) for out in outputs]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
