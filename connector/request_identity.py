"""What besides its tokens and tenant decides a request's KV: its LoRA adapter and its multimodal inputs.

Two requests with equal token ids can still have different KV. A LoRA adapter changes every layer's
K and V; a multimodal prompt's placeholder tokens stand for images (audio, video) whose embeddings
differ. vLLM's own prefix cache folds the same facts into its block hashes (the adapter's name and
path, each item's identifier and position). Here they become the request's *variant*, folded into
its key root (``NamespaceSpec.root``): its chunks live in a key space of their own, which requests
with another adapter, other media, or none, never reach. Since the cache outlives the engine, the
adapter is named by a fingerprint of its files, not only by the name it was loaded under.

A prompt with media therefore shares no chunk with one that has other media, even the text before the
first item: correct, at the price of some hits. Prompts given as embeddings have no token ids to key:
they are neither looked up nor published.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from indexer.fingerprint import fingerprint_model


def request_variant(request: Any, adapter_fingerprint: Callable[[str], str] = fingerprint_model) -> bytes | None:
    """The request's variant: ``b""`` for plain token prompts, a canonical description of its adapter and
    media otherwise, or None when it cannot be cached (a prompt given as embeddings)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    parts: list[list[object]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(lora.lora_path or "")
        parts.append(["lora", lora.lora_name, path, adapter_fingerprint(path) if path else ""])
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        parts.append(["mm", feature.modality, feature.identifier, position.offset, position.length])
    return json.dumps(parts, separators=(",", ":")).encode() if parts else b""
