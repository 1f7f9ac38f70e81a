"""Capture points and the key transforms between them.

Keys pass through three stages inside attention: ① `pre_norm` (the k_proj output), ② `post_norm` (after
the per-head k-norm, before RoPE) and ③ `post_rope` (what the engine stores). Values are the same at every
point. Translators act at one point; injection finishes the remaining stages with the *target's* own k-norm
and RoPE at the target positions, which is why these transforms call the model's own modules.
"""

from __future__ import annotations

import difflib
import sys

import torch
from torch import nn

from translators.errors import ConfigError
from translators.layout import CacheLayout, decoder_of, rotary_takes_layer_type

CAPTURE_POINTS = ("pre_norm", "post_norm", "post_rope")


def check_point(point: str) -> str:
    """Validate a capture point name.

    Raises:
        ConfigError: unknown name, with suggestions.
    """
    if point not in CAPTURE_POINTS:
        close = difflib.get_close_matches(point, CAPTURE_POINTS, n=2, cutoff=0.3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"unknown capture point {point!r}{hint} (choose from {', '.join(CAPTURE_POINTS)})")
    return point


def apply_k_norm(model: nn.Module, layout: CacheLayout, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """pre_norm → post_norm for one layer: the model's per-head key RMSNorm (identity if it has none).

    Args:
        keys: [n_tokens, n_kv_heads * head_dim].
    Returns:
        [n_tokens, n_kv_heads * head_dim].
    """
    kv = layout.layers[layer].kv
    if not kv.has_k_norm:
        return keys
    attn = decoder_of(model).layers[layer].self_attn
    n = keys.shape[0]
    return attn.k_norm(keys.view(n, kv.n_kv_heads, kv.head_dim)).reshape(n, kv.width)


def apply_rope(
    model: nn.Module, layout: CacheLayout, layer: int, keys: torch.Tensor, positions: torch.Tensor,
    *, inverse: bool = False,
) -> torch.Tensor:
    """post_norm → post_rope for one layer: the model's RoPE (for this layer's type) at `positions`.

    With `inverse`, post_rope → post_norm instead: RoPE rotates each feature pair by an angle (times the
    rope type's attention scaling s), so its inverse is the opposite rotation divided by s, exact up to
    rounding. A serving engine stores keys after RoPE at known positions; this recovers the post_norm point.

    Args:
        keys: [n_tokens, n_kv_heads * head_dim].
        positions: [n_tokens] integer positions (may repeat or skip).
    Returns:
        [n_tokens, n_kv_heads * head_dim].
    """
    kv = layout.layers[layer].kv
    decoder = decoder_of(model)
    attn = decoder.layers[layer].self_attn
    n = keys.shape[0]
    # Token-major [1, n, H, hd], a view of `keys` (cos/sin unsqueezed at dim 2 below): no copy in or out. Over a
    # transposed [1, H, n, hd] view the element-wise products with cos/sin ran ~40x slower (2.2 ms against
    # 0.055 ms per product at 2047 tokens, 3 heads of 64, one thread), which made RoPE the largest share of a
    # SmolLM2 switch at 2048 tokens.
    heads = keys.view(1, n, kv.n_kv_heads, kv.head_dim)
    position_ids = positions.to(keys.device).view(1, n)
    if rotary_takes_layer_type(decoder):
        cos, sin = decoder.rotary_emb(heads, position_ids, layout.layers[layer].layer_type)
    else:
        cos, sin = decoder.rotary_emb(heads, position_ids)
    if inverse:  # (c, s) scaled by s_a: the inverse rotation is (c, -s) / (c² + s²)
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    # The modeling module's own apply_rotary_pos_emb, so family quirks (partial rotary, layouts) carry over.
    apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    # It rotates a query and a key: the query slot gets one head, the key slot all of them.
    _, rotated = apply_rotary(heads[:, :, :1], heads, cos, sin, unsqueeze_dim=2)
    return rotated.reshape(n, kv.width)


def keys_to_point(
    model: nn.Module,
    layout: CacheLayout,
    layer: int,
    keys: torch.Tensor,
    *,
    start: str,
    end: str,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Advance keys from capture point `start` to a later point `end` (pre_norm → post_norm → post_rope).

    Raises:
        ConfigError: `end` comes before `start` (norm and RoPE are not inverted).
    """
    order = CAPTURE_POINTS.index(check_point(end)) - CAPTURE_POINTS.index(check_point(start))
    if order < 0:
        raise ConfigError(f"cannot move keys back from {start!r} to {end!r}")
    if start == "pre_norm" and end != "pre_norm":
        keys = apply_k_norm(model, layout, layer, keys)
    if end == "post_rope" and start != "post_rope":
        keys = apply_rope(model, layout, layer, keys, positions)
    return keys
