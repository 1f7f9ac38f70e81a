"""Write cache objects (e.g. translated keys and values) into a fresh transformers cache the target decodes from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from translators.errors import ConfigError
from translators.layout import CacheLayout
from translators.objects import cache_objects, engine_tensor, fill_cache_layer


def build_cache(
    model: nn.Module,
    layout: CacheLayout,
    *tensors: Sequence[torch.Tensor],
    point: str,
    positions: torch.Tensor | None = None,
) -> DynamicCache:
    """Build the target's cache from one list per cache object, in `cache_objects(layout)` order (GQA: keys
    at `point`, then values; MLA: latent, rotary key). See `write_cache`.

    Raises:
        ConfigError: a number of lists other than the layout's objects, wrong number of layers or shapes.
    """
    objects = cache_objects(layout)
    if len(tensors) != len(objects):
        raise ConfigError(
            f"the target's cache holds {len(objects)} objects ({', '.join(o.name for o in objects)}) per layer but "
            f"{len(tensors)} lists of tensors were given"
        )
    return write_cache(model, layout, {obj.name: t for obj, t in zip(objects, tensors)}, point=point, positions=positions)


def write_cache(
    model: nn.Module,
    layout: CacheLayout,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    *,
    point: str,
    positions: torch.Tensor | None = None,
) -> DynamicCache:
    """Build the target's cache from per-layer tensors of each cache object, keyed by object name.

    The target's own k-norm (from pre_norm) and RoPE (from pre_norm/post_norm) are applied at `positions`.
    Sliding-window layers keep only their window, as the engine does. Differentiable in every tensor, so
    stage 2 trains through it. Build a fresh cache for every forward: decoding extends it in place.

    Args:
        tensors: object name → one [n_tokens, width] tensor per target layer (GQA: "keys" at `point`, "values").
        positions: [n_tokens] positions of the cached tokens; default 0..n_tokens-1.
    Raises:
        ConfigError: objects other than the layout's, wrong number of layers or shapes.
    """
    objects = cache_objects(layout)
    if set(tensors) != {obj.name for obj in objects}:
        raise ConfigError(
            f"the target's cache holds {', '.join(o.name for o in objects)} per layer, got {', '.join(tensors)}"
        )
    if any(len(tensors[obj.name]) != layout.n_layers for obj in objects):
        given = " and ".join(f"{len(tensors[obj.name])} {obj.name}" for obj in objects)
        raise ConfigError(f"the target has {layout.n_layers} layers but {given} layers were given")
    n = tensors[objects[0].name][0].shape[0]
    positions = torch.arange(n) if positions is None else positions
    if positions.shape != (n,):
        raise ConfigError(f"positions must have shape [{n}], got {list(positions.shape)}")
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    for i in range(layout.n_layers):
        layer = [tensors[obj.name][i] for obj in objects]
        expected = [(n, obj.width(layout.layers[i])) for obj in objects]
        if any(x.shape != shape for x, shape in zip(layer, expected)):
            raise ConfigError(
                f"layer {i}: expected {', '.join(o.name for o in objects)} of shapes {[list(e) for e in expected]}, "
                f"got {[list(x.shape) for x in layer]}"
            )
        fill_cache_layer(cache, i, objects, [engine_tensor(obj, model, layout, i, x.to(dtype), point=point,
                                                           positions=positions) for obj, x in zip(objects, layer)])
    return cache


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


def write_hybrid_cache(
    model: nn.Module,
    layout: CacheLayout,
    tokens: Mapping[str, Mapping[int, torch.Tensor]],
    states: Mapping[str, Mapping[int, torch.Tensor]],
    *,
    point: str,
    positions: torch.Tensor | None = None,
) -> DynamicCache:
    """Build a hybrid target's cache: per-token objects for its attention layers, states for its linear layers.

    Attention layers go through the target's own k-norm and RoPE as in `write_cache`. Each linear-attention
    layer gets its conv window, then its recurrent state (`objects.LINEAR_STATE` order), out of place: the given
    tensors are never modified, and decoding on top of the cache keeps their autograd graphs, so stage 2 trains
    through states as through keys. Build a fresh cache for every forward.

    Args:
        tokens: object name → {attention layer → [n_tokens, width] at `point`} for every attention layer.
        states: "conv_window" → {linear layer → [1, C, K]}, "recurrent_state" → {linear layer → [1, Hv, dk, dv]}
            for every linear-attention layer.
        positions: [n_tokens] positions of the cached tokens; default 0..n_tokens-1.
    Raises:
        ConfigError: a layer's object missing, of the wrong shape, or given for a layer that does not hold it;
            positions of the wrong shape.
    """
    from translators.objects import CacheObject, layer_objects

    held = {(name, i) for group in (tokens, states) for name, xs in group.items() for i in xs}
    expected = {(obj.name, i) for i in range(layout.n_layers) for obj in layer_objects(layout, i)}
    if held != expected:
        missing = sorted(expected - held, key=lambda t: (t[1], t[0]))
        extra = sorted(held - expected, key=lambda t: (t[1], t[0]))
        raise ConfigError(
            f"the target's layers hold {_pairs(expected)}; missing {_pairs(missing) or 'nothing'}, "
            f"not held {_pairs(extra) or 'nothing'}")
    first = next((xs for xs in tokens.values() if xs), {})
    n = next(iter(first.values())).shape[0] if first else 0
    positions = torch.arange(n) if positions is None else positions
    if positions.shape != (n,):
        raise ConfigError(f"positions must have shape [{n}], got {list(positions.shape)}")
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config)
    for i in range(layout.n_layers):
        objects = layer_objects(layout, i)
        if isinstance(objects[0], CacheObject):
            layer = [tokens[obj.name][i] for obj in objects]
            shapes = [(n, obj.width(layout.layers[i])) for obj in objects]
            if any(x.shape != shape for x, shape in zip(layer, shapes)):
                raise ConfigError(f"layer {i}: expected {', '.join(o.name for o in objects)} of shapes "
                                  f"{[list(s) for s in shapes]}, got {[list(x.shape) for x in layer]}")
            fill_cache_layer(cache, i, objects, [engine_tensor(obj, model, layout, i, x.to(dtype), point=point,
                                                               positions=positions) for obj, x in zip(objects, layer)])
            continue
        for obj in objects:
            x = states[obj.name][i]
            shape = (1, *obj.shape(layout.layers[i]))
            if tuple(x.shape) != shape:
                raise ConfigError(f"layer {i}: {obj.name} must have shape {list(shape)}, got {list(x.shape)}")
            obj.write(cache, i, x.to(dtype))
    return cache


def _pairs(pairs) -> str:
    """'keys@3, conv_window@0' for (name, layer) pairs."""
    return ", ".join(f"{name}@{layer}" for name, layer in pairs)
