"""Cache-object adapters: one per kind of per-layer cache tensor a translator maps.

A model's cache is a set of typed objects per layer. Everything that walks a cache (capture, Gram statistics,
solvers, the translator, artifacts, the switch, conversations, distillation) iterates over the objects a
layout holds instead of assuming keys and values. Each object's adapter owns

- its name: artifact tensor names (`<name>_<layer>`), statistics files (`<name>.safetensors`), JSON keys;
- its feature width per layer (the flattened row a map reads or writes);
- capture: the decoder-layer module whose forward output is the object at `pre_norm`, and how to move it
  to a later capture point (`advance`);
- writing into the engine cache: the tensor the engine stores for it (`engine`).

GQA layouts hold `KEYS` and `VALUES` of their attention K/V; MLA layouts hold `LATENT` and `ROPE_KEY`, and
sparse-attention (DSA) layouts add `INDEXER_KEYS`. These are per-token objects (`CacheObject`).

Linear-attention layers of hybrid models (Gated DeltaNet) hold whole-prompt objects instead (`StateObject`):
`CONV_WINDOW` [1, C, K] and `RECURRENT_STATE` [1, Hv, dk, dv]. A hybrid layout mixes kinds across layers, so
its objects are per layer (`layer_objects`); `cache_objects` stays the uniform-layout entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from translators import mla
from translators.errors import ConfigError, UnsupportedModelError
from translators.layout import CacheLayout, ConvWindow, IndexerKeys, LayerLayout, MLALatent, RecurrentState
from translators.points import CAPTURE_POINTS, check_point, keys_to_point

ATTENTION_KV = "attention_kv"  # `AttentionKV.kind`: the layout object the GQA pair lives in

# Where an object goes in the engine cache: the layer's (keys, values) pair, or the DSA indexer's key cache.
SLOTS = ("keys", "values", "indexer")


@dataclass(frozen=True)
class CacheObject:
    """One kind of per-layer cache tensor, flattened per token to [n_tokens, width].

    Fields (plain functions, so a new kind is a new instance, not a subclass):
        name: unique object name, e.g. "keys"; used in artifact tensor names, statistics files and JSON keys.
        width: layer layout → features per token (e.g. n_kv_heads * head_dim).
        module: decoder layer → the submodule whose forward output (row 0: [n_tokens, ≥ width]) holds this
            object at `pre_norm` (capture hooks it).
        advance: (model, layout, layer, x, *, start, end, positions) → x moved from capture point `start` to
            the later point `end`; [n_tokens, width] → [n_tokens, width].
        engine: (layout, layer, x) → the tensor the engine cache stores, from x at `post_rope`.
        slot: where the engine cache keeps it, one of SLOTS.
        read: (layer layout, module output row [n_tokens, ·]) → the object's columns [n_tokens, width]; MLA's
            latent and rotary key share one projection. Default: the whole output.
        differentiable: the model's forward passes gradients into the object (the DSA indexer's top-k
            selection does not).
    """

    name: str
    width: Callable[[LayerLayout], int]
    module: Callable[[nn.Module], nn.Module]
    advance: Callable[..., torch.Tensor]
    engine: Callable[[CacheLayout, int, torch.Tensor], torch.Tensor]
    slot: str
    read: Callable[[LayerLayout, torch.Tensor], torch.Tensor] = lambda layer, output: output
    differentiable: bool = True


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


KEYS = CacheObject("keys", _kv_width, _k_proj, _advance_keys, heads_first, slot="keys")
VALUES = CacheObject("values", _kv_width, _v_proj, _advance_values, heads_first, slot="values")
GQA = (KEYS, VALUES)  # the engine cache stores (keys, values) per layer, in this order


# --- The MLA adapters (latent + shared rotary key) and DSA indexer keys ------------------------------


def _latent_width(layer: LayerLayout) -> int:
    return layer.object_of(MLALatent).kv_lora_rank


def _rope_key_width(layer: LayerLayout) -> int:
    return layer.object_of(MLALatent).rope_dim


def _kv_a_proj(decoder_layer: nn.Module) -> nn.Module:
    return decoder_layer.self_attn.kv_a_proj_with_mqa


def _latent_columns(layer: LayerLayout, output: torch.Tensor) -> torch.Tensor:
    """kv_a_proj_with_mqa's output is [latent | k_pe]; the latent is the first kv_lora_rank columns."""
    return output[..., : _latent_width(layer)]


def _rope_key_columns(layer: LayerLayout, output: torch.Tensor) -> torch.Tensor:
    return output[..., _latent_width(layer):]


def _steps(start: str, end: str) -> tuple[bool, bool]:
    """(passes the norm, passes RoPE) going from capture point `start` to `end`.

    Raises:
        ConfigError: unknown point, or `end` before `start` (inverting a norm is not defined).
    """
    first, last = CAPTURE_POINTS.index(check_point(start)), CAPTURE_POINTS.index(check_point(end))
    if last < first:
        raise ConfigError(f"cannot move a cache object back from {start!r} to {end!r}")
    return first == 0 and last >= 1, first <= 1 and last == 2


def _advance_latent(model, layout, layer, x, *, start, end, positions):
    """The latent passes `kv_a_layernorm` between ① and ②; RoPE does not touch it."""
    norm, _ = _steps(start, end)
    return mla.normalise_latent(model, layer, x) if norm else x


def _advance_rope_key(model, layout, layer, x, *, start, end, positions):
    """The shared rotary key has no norm; it is rotated between ② and ③."""
    _, rope = _steps(start, end)
    return mla.rotate_rope_key(model, layout, layer, x, positions) if rope else x


def one_head(layout: CacheLayout, layer: int, x: torch.Tensor) -> torch.Tensor:
    """[n_tokens, width] → [1, 1, n_tokens, width]: MLA caches its latent and rotary key as one head."""
    return x.view(1, 1, *x.shape)


LATENT = CacheObject("latent", _latent_width, _kv_a_proj, _advance_latent, one_head, slot="keys",
                     read=_latent_columns)
ROPE_KEY = CacheObject("rope_key", _rope_key_width, _kv_a_proj, _advance_rope_key, one_head, slot="values",
                       read=_rope_key_columns)
MLA = (LATENT, ROPE_KEY)  # the engine stores them as the layer's (keys, values)


def _indexer_width(layer: LayerLayout) -> int:
    return layer.object_of(IndexerKeys).head_dim


def _indexer_wk(decoder_layer: nn.Module) -> nn.Module:
    return decoder_layer.self_attn.indexer.wk


def _advance_indexer_keys(model, layout, layer, x, *, start, end, positions):
    """Indexer keys pass the indexer's LayerNorm (① → ②), then RoPE on their first rope_dim features (② → ③)."""
    norm, rope = _steps(start, end)
    if norm:
        x = mla.normalise_indexer_keys(model, layer, x)
    return mla.rotate_indexer_keys(model, layout, layer, x, positions) if rope else x


def batch_first(layout: CacheLayout, layer: int, x: torch.Tensor) -> torch.Tensor:
    """[n_tokens, width] → [1, n_tokens, width], the indexer key cache's layout."""
    return x.unsqueeze(0)


INDEXER_KEYS = CacheObject("indexer_keys", _indexer_width, _indexer_wk, _advance_indexer_keys, batch_first,
                           slot="indexer", differentiable=False)
DSA = (*MLA, INDEXER_KEYS)

# --- The linear-attention adapters (conv window + recurrent state) ------------------------------------


@dataclass(frozen=True)
class StateObject:
    """One kind of whole-prompt cache tensor of a linear-attention layer (no token axis).

    Fields (plain functions, so a new kind is a new instance, not a subclass):
        name: unique object name ("recurrent_state", "conv_window"); artifact tensor names, JSON keys.
        shape: layer layout → the tensor's shape without the batch axis.
        read: (transformers cache, layer) → the engine's tensor [batch, *shape] (None before any prefill).
        write: (transformers cache, layer, x [batch, *shape]) → None; out of place with respect to x, and
            such that a forward decoding on top of the cache keeps x's autograd graph intact.
        differentiable: gradients flow from the model's output into the object.
    """

    name: str
    shape: Callable[[LayerLayout], tuple[int, ...]]
    read: Callable[..., torch.Tensor | None]
    write: Callable[..., None]
    differentiable: bool = True


def _conv_shape(layer: LayerLayout) -> tuple[int, ...]:
    return layer.object_of(ConvWindow).shape


def _state_shape(layer: LayerLayout) -> tuple[int, ...]:
    return layer.object_of(RecurrentState).shape


def _read_conv(cache, layer: int) -> torch.Tensor | None:
    return cache.get_conv_state(layer)


def _read_state(cache, layer: int) -> torch.Tensor | None:
    return cache.get_recurrent_state(layer)


def _write_conv(cache, layer: int, x: torch.Tensor) -> None:
    """The engine's own `update_conv_state`: it copies x into a fresh [B, C, K] buffer (x itself is never written
    to) and marks the layer as holding a previous state. Decoding updates that buffer in place, which autograd
    allows: the conv reads it through a concatenation that saves nothing for backward."""
    cache.update_conv_state(x, layer, conv_kernel_size=x.shape[-1])


def _assign_recurrent_state(cache_layer, recurrent_states: torch.Tensor, state_idx: int = 0, **_kwargs) -> torch.Tensor:
    """Out-of-place `update_recurrent_state` for one cache layer: store the new state instead of copying it into
    the buffer the same forward read (transformers' in-place copy breaks backward through an injected state)."""
    cache_layer.recurrent_states[state_idx] = recurrent_states
    cache_layer.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states


def _write_state(cache, layer: int, x: torch.Tensor) -> None:
    """Store x as the layer's recurrent state and make every later update of this layer out of place.

    Raises:
        ConfigError: the layer's conv window was not written first (the engine reads a state only once its layer
            holds a previous conv window).
    """
    cache_layer = cache.layers[layer]
    if not cache_layer.has_previous_state[0]:
        raise ConfigError(f"layer {layer}: write the conv window before the recurrent state")
    cache_layer.update_recurrent_state = partial(_assign_recurrent_state, cache_layer)
    cache_layer.update_recurrent_state(x)


CONV_WINDOW = StateObject("conv_window", _conv_shape, _read_conv, _write_conv)
RECURRENT_STATE = StateObject("recurrent_state", _state_shape, _read_state, _write_state)
LINEAR_STATE = (CONV_WINDOW, RECURRENT_STATE)  # written in this order (the engine's own order in a prefill)

# The adapters of each combination of layout object kinds a layer can hold.
_ADAPTERS = {
    (ATTENTION_KV,): GQA,
    ("mla_latent",): MLA,
    ("mla_latent", "indexer_keys"): DSA,
    ("recurrent_state", "conv_window"): LINEAR_STATE,
}

# Every per-token object name some adapter defines (statistics files name their object; unknown names are
# refused). States have no token axis, so no token-wise statistics.
OBJECT_NAMES = tuple(dict.fromkeys(obj.name for objects in _ADAPTERS.values() for obj in objects
                                   if isinstance(obj, CacheObject)))


# --- Layout → objects -----------------------------------------------------------------------------


def layer_objects(layout: CacheLayout, layer: int) -> tuple[CacheObject | StateObject, ...]:
    """The adapters of the objects one layer holds, in the order the engine cache stores (or is written) them.

    Raises:
        UnsupportedModelError: the layer holds an object kind without an adapter.
    """
    kind = tuple(obj.kind for obj in layout.layers[layer].objects)
    if kind not in _ADAPTERS:
        raise UnsupportedModelError(f"{layout.family}: no adapter for the cache objects {list(kind)} of layer {layer}")
    return _ADAPTERS[kind]


def cache_objects(layout: CacheLayout) -> tuple[CacheObject, ...]:
    """The objects every layer of `layout` holds, in the order the engine cache stores them.

    Raises:
        UnsupportedModelError: a layer holds an object kind without an adapter, or layers hold different kinds
            (a hybrid: see `layer_objects`, `translators.capture.capture_hybrid`, `translators.inject.write_hybrid_cache`).
    """
    kinds = {tuple(obj.kind for obj in layer.objects) for layer in layout.layers}
    if len(kinds) != 1:
        raise UnsupportedModelError(
            f"{layout.family}: layers hold different cache objects {sorted(kinds)} (a hybrid model); this path "
            "supports models whose layers all hold the same objects")
    return layer_objects(layout, 0)


def object_names(layout: CacheLayout) -> tuple[str, ...]:
    """Names of the objects `layout` holds, in first-seen layer order, e.g. ("keys", "values"); a hybrid's
    attention objects and its linear layers' states together."""
    return tuple(dict.fromkeys(obj.name for i in range(layout.n_layers) for obj in layer_objects(layout, i)))


def object_width(obj: CacheObject, layout: CacheLayout) -> int:
    """The object's width, which must be the same in every layer for a translator.

    Raises:
        UnsupportedModelError: the width differs across layers.
    """
    widths = {obj.width(layer) for layer in layout.layers}
    if len(widths) != 1:
        raise UnsupportedModelError(f"{layout.family}: {obj.name} widths differ across layers: {sorted(widths)}")
    return widths.pop()


def engine_tensor(
    obj: CacheObject, model: nn.Module, layout: CacheLayout, layer: int, x: torch.Tensor, *, point: str,
    positions: torch.Tensor,
) -> torch.Tensor:
    """What the engine stores for `obj` in `layer`, from x ([n_tokens, width] at `point`, in the model's dtype).

    The model's own remaining transforms (keys: k-norm and RoPE at `positions`) are applied first.
    """
    return obj.engine(layout, layer, obj.advance(model, layout, layer, x, start=point, end="post_rope", positions=positions))


def fill_cache_layer(cache, layer: int, objects: tuple[CacheObject, ...], engine: list[torch.Tensor]) -> None:
    """Append one layer's engine tensors (from `engine_tensor`, in `objects` order) to a transformers cache.

    The (keys, values) slots go through `cache.update`, indexer keys through `cache.update_indexer`; both
    concatenate, so filling a cache span by span (cross-tokenizer runs) appends each span.

    Raises:
        ConfigError: the objects do not fill both the keys and values slots exactly once.
    """
    by_slot = {obj.slot: x for obj, x in zip(objects, engine, strict=True)}
    if len(by_slot) != len(objects) or not {"keys", "values"} <= set(by_slot):
        raise ConfigError(f"cache objects {[obj.name for obj in objects]} do not fill the keys and values slots once")
    cache.update(by_slot["keys"], by_slot["values"], layer)
    if "indexer" in by_slot:
        cache.update_indexer(by_slot["indexer"], layer)


def same_kinds(source: CacheLayout, target: CacheLayout) -> bool:
    """Both layouts hold the same cache objects (GQA and GQA, MLA and MLA), whatever their widths."""
    return cache_objects(source) == cache_objects(target)


def object_inputs(
    source: CacheLayout, target: CacheLayout, names: tuple[str, ...] | None = None
) -> dict[str, tuple[str, ...]]:
    """The source objects each target object's map reads (`Translator.inputs`).

    Between layouts of the same kinds every object reads its own name (`names`: the objects to map, default
    the target's). Across kinds, a target object the source also holds reads that object (a DSA target's
    latent ← an MLA source's latent); any other reads every source object of the attention cache (the keys
    and values slots), concatenated: GQA → MLA maps [keys | values] to the latent and to the rotary key,
    MLA → GQA maps [latent | rotary key] to keys and to values, MLA → DSA feeds the indexer keys from
    [latent | rotary key].

    Raises:
        UnsupportedModelError: either layout has no adapter (see `cache_objects`).
    """
    if same_kinds(source, target):
        return {name: (name,) for name in (names or object_names(target))}
    held = {obj.name for obj in cache_objects(source)}
    attention = tuple(obj.name for obj in cache_objects(source) if obj.slot in ("keys", "values"))
    return {obj.name: (obj.name,) if obj.name in held else attention for obj in cache_objects(target)}


def input_width(layout: CacheLayout, objects: tuple[CacheObject, ...]) -> int:
    """Features per source layer of `objects` of `layout` side by side (each width the same in every layer).
    Raises UnsupportedModelError otherwise."""
    return sum(object_width(obj, layout) for obj in objects)
