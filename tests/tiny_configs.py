"""Tiny random-init configs, one per supported family, built in-process (no files, no network)."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

# initializer_range 0.2 (instead of 0.02) makes attention sharp enough that a wrong cache visibly moves logits.
_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def tiny_config(family: str, **overrides):
    common = {**_COMMON, **overrides}
    if family == "llama":
        return LlamaConfig(**common, num_hidden_layers=3, num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    if family == "mistral":
        return MistralConfig(**common, num_hidden_layers=2, num_key_value_heads=2, sliding_window=None)
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    raise ValueError(family)


FAMILIES = ("llama", "qwen3", "mistral", "gemma3")


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (whitespace words; unknown words → <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(_COMMON["vocab_size"] - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def save_tiny_model_dir(family: str, path, seed: int = 0, **overrides):
    """Write a tiny random-init model plus tokenizer as a local HF directory; returns the path."""
    tiny_model(family, seed, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def words(n: int, seed: int = 0) -> str:
    """A prompt of n tokens for the tiny tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, _COMMON["vocab_size"] - 2, (n,), generator=g))


def noisy_identity(layout, scale=0.3, seed=0):
    """Self-translation maps: identity plus noise, which distillation must pull back toward the identity."""
    from translators.translator import Translator

    n, d = layout.n_layers, layout.kv_width
    tr = Translator({s: {t: (t,) for t in range(n)} for s in ("keys", "values")}, d, d, "pre_norm")
    g = torch.Generator().manual_seed(seed)
    for p in tr.maps.values():
        p.data.copy_(torch.eye(d) + scale * torch.randn(d, d, generator=g) / math.sqrt(d))
    return tr
