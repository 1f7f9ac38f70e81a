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


def write_small_fit(root, seed_offset: int = 0, **config) -> tuple:
    """A 30-document text corpus of the tiny tokenizer's words (root/docs.jsonl) and a fit config reading it with
    small caps and 20 + 6 samples (root/fit.yaml), `config` added; returns (data path, config path)."""
    import json

    import yaml

    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=seed_offset + i)}) for i in range(30)))
    path = root / "fit.yaml"
    path.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8,
                                    "n_train": 20, "n_val": 6, **config}))
    return data, path


def noisy_identity(layout, scale=0.3, seed=0):
    """Self-translation maps: identity plus noise, which distillation must pull back toward the identity."""
    from translators.translator import Translator

    n, d = layout.n_layers, layout.kv_width
    tr = Translator({s: {t: (t,) for t in range(n)} for s in ("keys", "values")}, d, d, "pre_norm")
    g = torch.Generator().manual_seed(seed)
    for p in tr.maps.values():
        p.data.copy_(torch.eye(d) + scale * torch.randn(d, d, generator=g) / math.sqrt(d))
    return tr


# MLA (DeepSeek-V3) and MLA + sparse-attention indexer (DeepSeek-V3.2), dense MLPs only. index_topk 6 is well
# below the test prompts' lengths, so the indexer's keys decide which positions attention reads.
_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1)
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32")


def tiny_mla_config(family: str, **overrides):
    from transformers import DeepseekV3Config, DeepseekV32Config

    common = {**_COMMON, **_MLA, **overrides}
    if family == "deepseek_v3":
        return DeepseekV3Config(**{"q_lora_rank": None, **common})
    if family == "deepseek_v32":
        return DeepseekV32Config(**{"q_lora_rank": 24, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 6,
                                    **common})
    raise ValueError(family)


def tiny_mla_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_mla_config(family, **overrides), dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def save_tiny_mla_model_dir(family: str, path, seed: int = 0, **overrides):
    """Write a tiny random-init MLA/DSA model plus tokenizer as a local HF directory; returns the path."""
    tiny_mla_model(family, seed, **overrides).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# Gated DeltaNet hybrid (Qwen3.5): layers 0-1 linear attention (conv window + recurrent state), layer 2 attention.
# Two value heads per key head, so the state's head axis differs from the key heads'.
_GDN = dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention"])


def tiny_gdn_config(**overrides):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**_COMMON, **_GDN, **overrides})


def tiny_gdn_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_gdn_config(**overrides), dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def exact_hybrid_copy(layout):
    """A `translators.hybrid.HybridTranslator` from a hybrid model into itself that is exact: copied states and
    identity K/V maps."""
    from translators.hybrid import HybridTranslator, strategies_for
    from translators.states import COPY, StateMaps

    translator = HybridTranslator(layout, layout, StateMaps(layout, layout, strategies_for(layout, COPY)))
    with torch.no_grad():
        for weight in translator.kv.values():
            weight.copy_(torch.eye(weight.shape[0]))
    return translator


# Kimi-Linear hybrid: layers 0-1 Kimi Delta Attention (one conv over [q | k | v], per-channel decay), layer 2 a
# NoPE MLA (its shared key is never rotated; Kimi-Linear has no rotary module). Dense MLPs only.
_KDA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, q_lora_rank=None, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention"], mlp_layer_types=["dense"] * 3,
            pad_token_id=0, bos_token_id=None, eos_token_id=1)


def tiny_kda_config(**overrides):
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**{**_COMMON, **_KDA, **overrides})


def tiny_kda_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_kda_config(**overrides), dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model
