"""Text to token ids for the admin API, with the tokenizer of the namespace's model, when this node has it.

Only tokenizers already on this machine are loaded (``local_files_only``): the daemon never reaches
out to a model hub on behalf of a request, and never runs a model repository's code. Token ids match
what vLLM computes for a completion prompt (special tokens included, no chat template); send
``token_ids`` for anything else.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from prefixcache.indexer.errors import PrefixCacheError


class TokenizerUnavailableError(PrefixCacheError, LookupError):
    """No tokenizer for this model on this node: the caller should send token ids."""


class LocalTokenizers:
    """Tokenizers by model name, loaded once each (loading takes seconds; tokenizing, milliseconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def encode(self, model: str, text: str) -> list[int]:
        return list(self._load(model)(text)["input_ids"])

    def _load(self, model: str) -> Any:
        with self._lock:  # one load at a time: two requests for a new model load it once
            return _tokenizer(model)


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerUnavailableError("text needs the transformers package on this node; send token_ids") from exc
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for "not here"
        raise TokenizerUnavailableError(
            f"no tokenizer for model {model!r} on this node ({type(exc).__name__}); send token_ids"
        ) from exc
