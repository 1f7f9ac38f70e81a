"""The transforms of MLA caches and sparse-attention indexer keys between capture points (DeepSeek-V2/V3/V3.2).

An MLA layer caches, per token, one joint K/V latent c (`kv_lora_rank` wide) and one rotary key k_pe shared by
every head (`qk_rope_head_dim` wide); both come out of one projection, `kv_a_proj_with_mqa`. The three capture
points mean, for them:

    ① pre_norm   c as projected,              k_pe as projected (not rotated)
    ② post_norm  c after `kv_a_layernorm`,    k_pe not rotated
    ③ post_rope  c after `kv_a_layernorm`,    k_pe rotated at its position (what the engine stores)

A DeepSeek-V3.2 (DSA) layer adds the lightning indexer's key: ① `indexer.wk` output, ② after the indexer's
LayerNorm, ③ with RoPE on its first `qk_rope_head_dim` features (half-split rotation, unlike the main
attention's interleaved one). Injection finishes the remaining transforms with the *target's* own norm and RoPE
at the target positions, so these call the model's own modules.

RoPE un-rotation (③ → ②) is exact: rotation by −θ·position inverts it (`unrotate_rope_key`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from translators.layout import CacheLayout, IndexerKeys, MLALatent, decoder_of


def mla_object(layout: CacheLayout, layer: int) -> MLALatent:
    """The MLA latent object of one layer (raises UnsupportedModelError if the layer holds none)."""
    return layout.layers[layer].object_of(MLALatent)


def indexer_object(layout: CacheLayout, layer: int) -> IndexerKeys:
    """The indexer-keys object of one layer (raises UnsupportedModelError if the layer holds none)."""
    return layout.layers[layer].object_of(IndexerKeys)


def normalise_latent(model: nn.Module, layer: int, latent: torch.Tensor) -> torch.Tensor:
    """① → ② for the latent: the layer's `kv_a_layernorm` (RMSNorm). [n_tokens, kv_lora_rank] → same."""
    return decoder_of(model).layers[layer].self_attn.kv_a_layernorm(latent)


def _cos_sin(model: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's rotary cos/sin at `positions`: each [1, n_tokens, rope_dim]."""
    return decoder_of(model).rotary_emb(x, positions.to(x.device).view(1, -1))


def _modeling(model: nn.Module, layer: int):
    """The modeling module of the layer's attention class (its own rotary helpers, so family quirks carry over)."""
    return sys.modules[type(decoder_of(model).layers[layer].self_attn).__module__]


def rotate_rope_key(
    model: nn.Module, layout: CacheLayout, layer: int, k_pe: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """② → ③ for the shared rotary key: the model's RoPE (interleaved or half-split, as it is configured); the
    identity for a NoPE MLA (Kimi-Linear caches the key as projected).

    Args:
        k_pe: [n_tokens, qk_rope_head_dim]. positions: [n_tokens] integer positions.
    Returns:
        [n_tokens, qk_rope_head_dim].
    """
    if not mla_object(layout, layer).rotary:
        return k_pe
    heads = k_pe.view(1, 1, *k_pe.shape)  # [1, 1 head, n, rope]
    cos, sin = _cos_sin(model, heads, positions)
    modeling = _modeling(model, layer)
    rotary = modeling.apply_rotary_pos_emb_interleave if mla_object(layout, layer).interleaved else modeling.apply_rotary_pos_emb
    _, rotated = rotary(heads, heads, cos, sin)
    return rotated.view(k_pe.shape)


def unrotate_rope_key(
    model: nn.Module, layout: CacheLayout, layer: int, k_pe: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """③ → ② for the shared rotary key, exactly: rotation by the opposite angles (sin → −sin).

    Interleaved RoPE permutes the features to half-split order before rotating, so the inverse rotates back
    with −sin and then undoes that permutation; a NoPE MLA's key is returned as it is.
    [n_tokens, qk_rope_head_dim] → same.
    """
    if not mla_object(layout, layer).rotary:
        return k_pe
    heads = k_pe.view(1, 1, *k_pe.shape)
    cos, sin = _cos_sin(model, heads, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, n, rope]
    half = k_pe.shape[-1] // 2
    x1, x2 = heads[..., :half], heads[..., half:]
    # x·cos − rotate_half(x)·(−sin), over cos² + sin²: rope scalings (YaRN's mscale) scale cos and sin alike.
    unrotated = (heads * cos + torch.cat((x2, -x1), dim=-1) * sin) / (cos**2 + sin**2)
    if mla_object(layout, layer).interleaved:
        # The forward maps feature 2i → i and 2i+1 → half + i; put them back.
        unrotated = torch.stack((unrotated[..., :half], unrotated[..., half:]), dim=-1).flatten(-2)
    return unrotated.view(k_pe.shape)


def normalise_indexer_keys(model: nn.Module, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """① → ② for indexer keys: the indexer's LayerNorm. [n_tokens, index_head_dim] → same."""
    return decoder_of(model).layers[layer].self_attn.indexer.k_norm(keys)


def rotate_indexer_keys(
    model: nn.Module, layout: CacheLayout, layer: int, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """② → ③ for indexer keys: half-split RoPE on the first `rope_dim` features, the rest unchanged.

    Args:
        keys: [n_tokens, index_head_dim]. positions: [n_tokens].
    Returns:
        [n_tokens, index_head_dim].
    """
    rope_dim = indexer_object(layout, layer).rope_dim
    k_rot, k_pass = keys[:, :rope_dim], keys[:, rope_dim:]
    heads = k_rot.view(1, 1, *k_rot.shape)
    cos, sin = _cos_sin(model, heads, positions)
    _, rotated = _modeling(model, layer).apply_rotary_pos_emb(heads, heads, cos, sin)
    return torch.cat((rotated.view(k_rot.shape), k_pass), dim=-1)
