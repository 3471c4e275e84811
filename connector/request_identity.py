"""What besides its tokens and tenant decides a request's KV: its LoRA adapter and its multimodal inputs.

Two requests with equal token ids can still have different KV. A LoRA adapter changes every layer's
K and V; a multimodal prompt's placeholder tokens stand for images (audio, video) whose embeddings
differ. vLLM's own prefix cache folds the same facts into its block hashes (the adapter's name and
path; each item's identifier and position, in the blocks from the item's on).

- The adapter becomes the request's *variant*, folded into its key root (``NamespaceSpec.root``): its
  chunks live in a key space of their own. Since the cache outlives the engine, the adapter is named by
  a fingerprint of its files, not only by the name it was loaded under.
- Media are marked in the chunk where each item begins (``media_marks``): that chunk is keyed under a
  media parent (``prefixcache.indexer.keys.media_parent``), and every later chunk after it through the chain. The
  chunks before the first item keep the keys of the same text without media, so a system prompt is
  shared by requests whatever images follow it, and nothing from an item's chunk on is shared by
  requests whose media differ.

Prompts given as embeddings have no token ids to key: they are neither looked up nor published.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prefixcache.indexer.fingerprint import fingerprint_model


def request_variant(request: Any, adapter_fingerprint: Callable[[str], str] = fingerprint_model) -> bytes | None:
    """The request's variant: ``b""`` without a LoRA adapter, a canonical description of the adapter
    otherwise, or None when it cannot be cached (a prompt given as embeddings)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return b""
    path = str(lora.lora_path or "")
    return json.dumps(
        [["lora", lora.lora_name, path, adapter_fingerprint(path) if path else ""]], separators=(",", ":")
    ).encode()


def media_ends(request: Any) -> tuple[int, ...]:
    """Where each of the request's media items' placeholder tokens end (exclusive)."""
    return tuple(f.mm_position.offset + f.mm_position.length for f in getattr(request, "mm_features", None) or ())


def media_marks(request: Any, chunk_tokens: int) -> dict[int, bytes]:
    """Per chunk position, a canonical description of the request's media items whose placeholder tokens
    begin in that chunk (each by modality, identifier, offset and length in the prompt)."""
    items: defaultdict[int, list[list[object]]] = defaultdict(list)
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        items[position.offset // chunk_tokens].append(
            [feature.modality, feature.identifier, position.offset, position.length]
        )
    return {chunk: json.dumps(sorted(found, key=str), separators=(",", ":")).encode() for chunk, found in items.items()}
