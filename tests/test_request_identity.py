"""A request's variant: what besides tokens and tenant decides its KV (LoRA adapter, multimodal inputs)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from prefixcache.connector.request_identity import media_marks, request_variant
from prefixcache.indexer.namespace import NamespaceSpec

SPEC = NamespaceSpec(model="m", model_fingerprint="f", kv_dtype="bfloat16", kv_layout="l", chunk_tokens=256)


def request(**fields) -> SimpleNamespace:
    """The fields of vLLM's ``Request`` that decide a variant."""
    return SimpleNamespace(
        **{"prompt_token_ids": [1, 2, 3], "prompt_embeds": None, "lora_request": None, "mm_features": [], **fields}
    )


def image(identifier: str, offset: int, length: int = 64) -> SimpleNamespace:
    return SimpleNamespace(
        modality="image", identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def adapter(directory: Path, weights: bytes, alpha: int = 16) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text(f'{{"r": 8, "lora_alpha": {alpha}}}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


def lora(path: Path, name: str = "sql") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def test_a_plain_prompt_has_the_empty_variant_and_keeps_the_tenant_root():
    assert request_variant(request()) == b""
    assert SPEC.root("t", request_variant(request())) == SPEC.root("t")


def test_a_prompt_given_as_embeddings_is_not_cacheable():
    assert request_variant(request(prompt_token_ids=None, prompt_embeds=object())) is None
    assert request_variant(request(prompt_embeds=object())) is None


def test_each_adapter_is_named_by_its_files_not_only_its_name(tmp_path):
    path = adapter(tmp_path / "a", b"\x01" * 64)
    first = request_variant(request(lora_request=lora(path)))
    assert first and first == request_variant(request(lora_request=lora(path)))
    assert first != request_variant(request(lora_request=lora(path, name="other")))
    adapter(path, b"\x02" * 65)  # retrained in place, under the same name and path
    retrained = request_variant(request(lora_request=lora(path)))
    adapter(path, b"\x02" * 65, alpha=32)
    os.utime(path / "adapter_config.json", ns=(1, 1))
    rescaled = request_variant(request(lora_request=lora(path)))
    assert len({first, retrained, rescaled, b""}) == 4


def test_media_are_marked_in_the_chunk_they_begin_in_by_identifier_and_position():
    assert request_variant(request(mm_features=[image("cat", 5)])) == b""  # media are not a key space of their own
    assert media_marks(request(), 256) == {}
    media = ([image("cat", 300)], [image("dog", 300)], [image("cat", 301)], [image("cat", 300, length=65)])
    marks = [media_marks(request(mm_features=features), 256) for features in media]
    assert all(set(m) == {1} for m in marks) and len({m[1] for m in marks}) == 4
    assert marks[0] == media_marks(request(mm_features=[image("cat", 300)]), 256)
    two = media_marks(request(mm_features=[image("dog", 600), image("cat", 300), image("cow", 520)]), 256)
    assert set(two) == {1, 2} and two[1] == marks[0][1]
    assert two[2] == media_marks(request(mm_features=[image("cow", 520), image("dog", 600)]), 256)[2]


def test_a_variant_is_a_key_space_of_its_own_within_the_tenants():
    roots = {SPEC.root(None), SPEC.root("t"), SPEC.root(None, b"v"), SPEC.root("t", b"v"), SPEC.root("t", b"w")}
    assert len(roots) == 5
