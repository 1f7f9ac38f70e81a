"""Write keys and values (e.g. translated ones) into a fresh transformers cache the target decodes from."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from translators.errors import ConfigError
from translators.layout import CacheLayout
from translators.points import keys_to_point


def build_cache(
    model: nn.Module,
    layout: CacheLayout,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    point: str,
    positions: torch.Tensor | None = None,
) -> DynamicCache:
    """Build the target's cache from per-layer keys at `point` and values.

    The target's own k-norm (from pre_norm) and RoPE (from pre_norm/post_norm) are applied at `positions`.
    Sliding-window layers keep only their window, as the engine does. Differentiable in keys and values, so
    stage 2 trains through it. Build a fresh cache for every forward: decoding extends it in place.

    Args:
        keys, values: one [n_tokens, n_kv_heads * head_dim] tensor per target layer.
        positions: [n_tokens] positions of the cached tokens; default 0..n_tokens-1.
    Raises:
        ConfigError: wrong number of layers or shapes.
    """
    if len(keys) != layout.n_layers or len(values) != layout.n_layers:
        raise ConfigError(
            f"the target has {layout.n_layers} layers but {len(keys)} key and {len(values)} value tensors were given"
        )
    n = keys[0].shape[0]
    positions = torch.arange(n) if positions is None else positions
    if positions.shape != (n,):
        raise ConfigError(f"positions must have shape [{n}], got {list(positions.shape)}")
    dtype = next(model.parameters()).dtype
    data = []
    for i, (k, v) in enumerate(zip(keys, values)):
        kv = layout.layers[i].kv
        if k.shape != (n, kv.width) or v.shape != (n, kv.width):
            raise ConfigError(
                f"layer {i}: expected keys and values of shape [{n}, {kv.width}], got {list(k.shape)} and {list(v.shape)}"
            )
        k = keys_to_point(model, layout, i, k.to(dtype), start=point, end="post_rope", positions=positions)
        data.append((_heads_first(k, kv.n_kv_heads), _heads_first(v.to(dtype), kv.n_kv_heads)))
    return DynamicCache(ddp_cache_data=data, config=model.config)


def _heads_first(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_tokens, H * hd] → [1, H, n_tokens, hd], the engine's layout."""
    n = x.shape[0]
    return x.view(n, n_heads, -1).transpose(0, 1).unsqueeze(0)


def decode_step(
    model: nn.Module, cache: DynamicCache, token_ids: torch.Tensor, position: int | None = None, logits_to_keep: int = 0
) -> torch.Tensor:
    """Run the target on `token_ids` on top of `cache` (extended in place) and return its logits.

    Args:
        token_ids: [n_new] tokens after the cached prefix.
        position: position of the first new token; default: right after the cache.
        logits_to_keep: 0 keeps logits for every new token, k keeps the last k.
    Returns:
        [n_new or k, vocab] logits.
    """
    ids = token_ids.view(1, -1).to(model.device)
    kwargs = {}
    if position is not None:
        kwargs["position_ids"] = torch.arange(position, position + ids.shape[1], device=model.device).view(1, -1)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    return out.logits[0]
