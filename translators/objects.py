"""Cache-object adapters: one per kind of per-layer cache tensor a translator maps.

A model's cache is a set of typed objects per layer. Everything that walks a cache (capture, Gram statistics,
solvers, the translator, artifacts, the switch, conversations, distillation) iterates over the objects a
layout holds instead of assuming keys and values. Each object's adapter owns

- its name: artifact tensor names (`<name>_<layer>`), statistics files (`<name>.safetensors`), JSON keys;
- its feature width per layer (the flattened row a map reads or writes);
- capture: the decoder-layer module whose forward output is the object at `pre_norm`, and how to move it
  to a later capture point (`advance`);
- writing into the engine cache: the tensor the engine stores for it (`engine`).

Today every supported layout holds the GQA pair, `KEYS` and `VALUES` of its attention K/V. MLA (latent +
rotary key), recurrent (state + conv window) and indexer keys become further adapters here, returned by
`cache_objects` for the layouts that hold them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from translators.errors import UnsupportedModelError
from translators.layout import CacheLayout, LayerLayout
from translators.points import keys_to_point

ATTENTION_KV = "attention_kv"  # `AttentionKV.kind`: the layout object the GQA pair lives in


@dataclass(frozen=True)
class CacheObject:
    """One kind of per-layer cache tensor, flattened per token to [n_tokens, width].

    Fields (plain functions, so a new kind is a new instance, not a subclass):
        name: unique object name, e.g. "keys"; used in artifact tensor names, statistics files and JSON keys.
        width: layer layout → features per token (e.g. n_kv_heads * head_dim).
        module: decoder layer → the submodule whose forward output ([1, n_tokens, width]) is this object at
            `pre_norm` (capture hooks it).
        advance: (model, layout, layer, x, *, start, end, positions) → x moved from capture point `start` to
            the later point `end`; [n_tokens, width] → [n_tokens, width].
        engine: (layout, layer, x) → the tensor the engine cache stores, from x at `post_rope`.
    """

    name: str
    width: Callable[[LayerLayout], int]
    module: Callable[[nn.Module], nn.Module]
    advance: Callable[..., torch.Tensor]
    engine: Callable[[CacheLayout, int, torch.Tensor], torch.Tensor]


# --- The GQA adapter ------------------------------------------------------------------------------


def _kv_width(layer: LayerLayout) -> int:
    """n_kv_heads * head_dim of the layer's attention K/V."""
    return layer.kv.width


def _k_proj(decoder_layer: nn.Module) -> nn.Module:
    return decoder_layer.self_attn.k_proj


def _v_proj(decoder_layer: nn.Module) -> nn.Module:
    return decoder_layer.self_attn.v_proj


def _advance_keys(
    model: nn.Module, layout: CacheLayout, layer: int, x: torch.Tensor, *, start: str, end: str, positions: torch.Tensor
) -> torch.Tensor:
    """Keys: the model's own k-norm and RoPE between points (see `points.keys_to_point`)."""
    return keys_to_point(model, layout, layer, x, start=start, end=end, positions=positions)


def _advance_values(
    model: nn.Module, layout: CacheLayout, layer: int, x: torch.Tensor, *, start: str, end: str, positions: torch.Tensor
) -> torch.Tensor:
    """Values are the same at every capture point."""
    return x


def heads_first(layout: CacheLayout, layer: int, x: torch.Tensor) -> torch.Tensor:
    """[n_tokens, H * hd] → [1, H, n_tokens, hd], the engine's layout of attention keys and values."""
    n = x.shape[0]
    return x.view(n, layout.layers[layer].kv.n_kv_heads, -1).transpose(0, 1).unsqueeze(0)


KEYS = CacheObject("keys", _kv_width, _k_proj, _advance_keys, heads_first)
VALUES = CacheObject("values", _kv_width, _v_proj, _advance_values, heads_first)
GQA = (KEYS, VALUES)  # the engine cache stores (keys, values) per layer, in this order

# Every object name some adapter defines (statistics files name their object; unknown names are refused).
OBJECT_NAMES = tuple(obj.name for obj in GQA)


# --- Layout → objects -----------------------------------------------------------------------------


def cache_objects(layout: CacheLayout) -> tuple[CacheObject, ...]:
    """The objects every layer of `layout` holds, in the order the engine cache stores them.

    Raises:
        UnsupportedModelError: a layer holds an object kind without an adapter, or layers hold different kinds.
    """
    kinds = {tuple(obj.kind for obj in layer.objects) for layer in layout.layers}
    if len(kinds) != 1:
        raise UnsupportedModelError(f"{layout.family}: layers hold different cache objects {sorted(kinds)}")
    kind = kinds.pop()
    if kind != (ATTENTION_KV,):
        raise UnsupportedModelError(f"{layout.family}: no adapter for the cache objects {list(kind)}")
    return GQA


def object_names(layout: CacheLayout) -> tuple[str, ...]:
    """Names of `cache_objects(layout)`, e.g. ("keys", "values")."""
    return tuple(obj.name for obj in cache_objects(layout))


def object_width(obj: CacheObject, layout: CacheLayout) -> int:
    """The object's width, which must be the same in every layer for a translator.

    Raises:
        UnsupportedModelError: the width differs across layers.
    """
    widths = {obj.width(layer) for layer in layout.layers}
    if len(widths) != 1:
        raise UnsupportedModelError(f"{layout.family}: {obj.name} widths differ across layers: {sorted(widths)}")
    return widths.pop()


def shared_width(objects: tuple[CacheObject, ...], layout: CacheLayout) -> int:
    """The one width of `objects` in `layout` (a translator's maps share one width).

    Raises:
        UnsupportedModelError: the objects' widths differ (from each other or across layers).
    """
    widths = {object_width(obj, layout) for obj in objects}
    if len(widths) != 1:
        names = ", ".join(obj.name for obj in objects)
        raise UnsupportedModelError(f"{layout.family}: {names} have different widths {sorted(widths)}")
    return widths.pop()


def engine_tensor(
    obj: CacheObject, model: nn.Module, layout: CacheLayout, layer: int, x: torch.Tensor, *, point: str,
    positions: torch.Tensor,
) -> torch.Tensor:
    """What the engine stores for `obj` in `layer`, from x ([n_tokens, width] at `point`, in the model's dtype).

    The model's own remaining transforms (keys: k-norm and RoPE at `positions`) are applied first.
    """
    return obj.engine(layout, layer, obj.advance(model, layout, layer, x, start=point, end="post_rope", positions=positions))
