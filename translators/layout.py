"""What a model's cache looks like: per layer, a set of typed cache objects.

The GQA families (Llama/SmolLM2, Qwen3, Gemma-3, Mistral) store one object per layer, an attention key/value
pair (`AttentionKV`). MLA families (DeepSeek-V2/V3) store a joint latent and a shared rotary key (`MLALatent`);
DeepSeek-V3.2 adds its sparse-attention indexer's keys (`IndexerKeys`). Hybrid models (Qwen3.5 / Qwen3-Next:
Gated DeltaNet + attention) mix kinds across layers: their linear-attention layers hold a recurrent state
(`RecurrentState`) and a conv window (`ConvWindow`) instead of per-token objects, their attention layers K/V.
Code that walks a layout asks for the kind it understands instead of assuming K/V everywhere. Each kind's adapter (capture, width, engine-cache writing, object names) is in
`translators.objects`.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from translators.errors import UnsupportedModelError

SLIDING = "sliding"
GLOBAL = "global"
LINEAR = "linear"  # the attention type of linear-attention (recurrent) layers; maps pair them only with each other


@dataclass(frozen=True)
class AttentionKV:
    """Keys and values of one attention layer, as the engine caches them.

    Keys and values are stored as [batch, n_kv_heads, seq, head_dim]; captures flatten heads to
    [n_tokens, n_kv_heads * head_dim].
    """

    attention: str  # GLOBAL or SLIDING
    window: int | None  # sliding-window length in tokens (None for global layers)
    n_kv_heads: int
    head_dim: int
    has_k_norm: bool  # per-head RMSNorm on keys before RoPE (Qwen3, Gemma-3)
    rope: tuple[tuple[str, Any], ...]  # this layer type's rope parameters, sorted (key, value) pairs
    kind: str = "attention_kv"

    @property
    def width(self) -> int:
        """Features per token once heads are flattened: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class MLALatent:
    """Multi-head latent attention (DeepSeek-V2/V3): per token a joint K/V latent [kv_lora_rank] (cached after
    `kv_a_layernorm`) and one rotary key shared by all heads [rope_dim] (cached after RoPE); the engine stores
    them as a one-head [batch, 1, seq, width] pair."""

    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim
    interleaved: bool  # RoPE on interleaved feature pairs (DeepSeek's layout) instead of half-split
    rope: tuple[tuple[str, Any], ...]
    rotary: bool = True  # False: NoPE MLA (Kimi-Linear), the shared key is never rotated
    attention: str = GLOBAL
    window: int | None = None
    kind: str = "mla_latent"


@dataclass(frozen=True)
class IndexerKeys:
    """The lightning indexer's key of a sparse-attention (DSA) layer: one head [head_dim], LayerNorm'd, its first
    rope_dim features rotated (half-split); the engine stores [batch, seq, head_dim]. The indexer only selects
    which positions attention reads (top-k), so no gradient flows through these keys."""

    head_dim: int  # index_head_dim
    rope_dim: int
    kind: str = "indexer_keys"


@dataclass(frozen=True)
class RecurrentState:
    """The recurrent state of one linear-attention layer (Gated DeltaNet, Kimi Delta Attention): one key_dim x value_dim matrix per
    value head, [batch, n_heads, key_dim, value_dim], the engine's state after the whole prompt. It has no token
    axis: it is captured from the engine cache (the final state) and written back as a whole."""

    n_heads: int  # linear_num_value_heads
    key_dim: int  # linear_key_head_dim
    value_dim: int  # linear_value_head_dim
    attention: str = LINEAR
    window: int | None = None
    kind: str = "recurrent_state"

    @property
    def shape(self) -> tuple[int, int, int]:
        """[n_heads, key_dim, value_dim], the state without its batch axis."""
        return self.n_heads, self.key_dim, self.value_dim


@dataclass(frozen=True)
class ConvWindow:
    """The short causal convolution's window of one linear-attention layer: the last `kernel` inputs of the conv
    (the projected [query | key | value] channels before the conv), [batch, channels, kernel], oldest first."""

    channels: int  # 2 * n_key_heads * key_dim + n_value_heads * value_dim
    kernel: int  # linear_conv_kernel_dim
    attention: str = LINEAR
    window: int | None = None
    kind: str = "conv_window"

    @property
    def shape(self) -> tuple[int, int]:
        """[channels, kernel], the window without its batch axis."""
        return self.channels, self.kernel


CacheObjectKind = AttentionKV | MLALatent | IndexerKeys | RecurrentState | ConvWindow


@dataclass(frozen=True)
class LayerLayout:
    index: int
    layer_type: str  # the transformers layer type name, e.g. "full_attention", "sliding_attention"
    objects: tuple[CacheObjectKind, ...]

    def object_of(self, kind: type):
        """The layer's object of class `kind` (AttentionKV, MLALatent, IndexerKeys, RecurrentState, ConvWindow).

        Raises:
            UnsupportedModelError: the layer holds no such object.
        """
        for obj in self.objects:
            if isinstance(obj, kind):
                return obj
        held = ", ".join(obj.kind for obj in self.objects)
        raise UnsupportedModelError(f"layer {self.index} holds no {kind.__name__} cache object (it holds {held})")

    @property
    def kv(self) -> AttentionKV:
        """The layer's attention K/V object.

        Raises:
            UnsupportedModelError: the layer holds no attention K/V (an MLA or hybrid layer).
        """
        return self.object_of(AttentionKV)

    @property
    def attention(self) -> str:
        """GLOBAL, SLIDING or LINEAR: the attention type of the layer's first object."""
        return self.objects[0].attention


@dataclass(frozen=True)
class CacheLayout:
    family: str  # transformers model_type of the decoder, e.g. "qwen3", "gemma3_text"
    layers: tuple[LayerLayout, ...]
    max_positions: int

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_types(self) -> list[str]:
        """Per layer GLOBAL/SLIDING/LINEAR; translators map only between layers of the same type."""
        return [layer.attention for layer in self.layers]

    @property
    def kv_width(self) -> int:
        """Flattened K/V width, which must be the same in every layer for a translator."""
        widths = {layer.kv.width for layer in self.layers}
        if len(widths) != 1:
            raise UnsupportedModelError(f"{self.family}: K/V widths differ across layers: {sorted(widths)}")
        return widths.pop()

    def signature(self) -> dict[str, Any]:
        """A JSON-able summary of the layout, stored in translator manifests."""
        return {
            "family": self.family,
            "n_layers": self.n_layers,
            "max_positions": self.max_positions,
            "layers": [_layer_signature(layer) for layer in self.layers],
        }


def _layer_signature(layer: LayerLayout) -> dict[str, Any]:
    """One layer of `CacheLayout.signature`; GQA layers keep the keys manifests have always had."""
    if len(layer.objects) == 1 and isinstance(layer.objects[0], AttentionKV):
        kv = layer.objects[0]
        return {"type": layer.layer_type, "attention": kv.attention, "window": kv.window,
                "n_kv_heads": kv.n_kv_heads, "head_dim": kv.head_dim, "k_norm": kv.has_k_norm}
    objects = [{k: v for k, v in asdict(obj).items() if k != "rope"} for obj in layer.objects]
    return {"type": layer.layer_type, "attention": layer.attention, "objects": objects}


def decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder (the module holding `.layers` and `.rotary_emb`) of a causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: no decoder with a `.layers` list (model.get_decoder().layers)"
        )
    return decoder


def _layer_types(text_config) -> list[str]:
    """Layer type names as the engine uses them to pick a cache layer class per layer."""
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        return list(types)
    window = getattr(text_config, "sliding_window", None)
    return ["sliding_attention" if window else "full_attention"] * text_config.num_hidden_layers


def _rope_parameters(text_config, layer_type: str) -> dict[str, Any]:
    """Rope parameters for one layer type; Gemma-3 keys them by layer type, others share one dict."""
    params = getattr(text_config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        return dict(params[layer_type])
    return {k: v for k, v in params.items() if not isinstance(v, dict)}


def missing_parts(model: nn.Module) -> list[str]:
    """What capture/injection needs but this model lacks (empty when supported)."""
    missing = []
    try:
        decoder = decoder_of(model)
    except UnsupportedModelError as err:
        return [str(err)]
    for i, layer in enumerate(decoder.layers):
        linear = getattr(layer, "linear_attn", None)
        if linear is not None and not _is_gated_deltanet(linear):
            missing.append(f"layer {i}: {type(linear).__name__} is not a Gated DeltaNet layer (the linear attention "
                           "supported is Gated DeltaNet and Kimi Delta Attention)")
            break
        if linear_mixer(layer) is not None:
            continue
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            missing.append(f"layer {i}: a `self_attn` attention module")
            break
        parts = ("kv_a_proj_with_mqa", "kv_a_layernorm") if _is_mla(attn) else ("k_proj", "v_proj")
        for part in parts:
            if not isinstance(getattr(attn, part, None), nn.Module):
                missing.append(f"layer {i}: separate `self_attn.{part}` projection (fused QKV is not supported)")
        # Only an MLA without a rotary module is position-free (Kimi-Linear's NoPE MLA); GQA keys are rotated.
        if not _is_mla(attn) and not hasattr(decoder, "rotary_emb"):
            missing.append("a rotary embedding module (decoder.rotary_emb): GQA attention is supported with RoPE only")
        if missing:
            break
    return missing


def cache_layout(model: nn.Module) -> CacheLayout:
    """Read the cache layout of a loaded causal LM.

    Raises:
        UnsupportedModelError: the architecture lacks something capture/injection needs (named).
    """
    missing = missing_parts(model)
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not supported for cache capture/injection; missing: " + "; ".join(missing)
        )
    config = model.config.get_text_config(decoder=True)
    decoder = decoder_of(model)
    types = _layer_types(config)
    layers = []
    for i, layer in enumerate(decoder.layers):
        rope = tuple(sorted((k, v) for k, v in _rope_parameters(config, types[i]).items() if _jsonable(v)))
        if linear_mixer(layer) is not None:
            objects = _linear_objects(linear_mixer(layer))
        elif _is_mla(layer.self_attn):
            objects = _mla_objects(layer.self_attn, config, rope, rotary=hasattr(decoder, "rotary_emb"))
        else:
            objects = (_attention_kv(layer.self_attn, config, types[i], rope),)
        layers.append(LayerLayout(index=i, layer_type=types[i], objects=objects))
    return CacheLayout(family=config.model_type, layers=tuple(layers), max_positions=config.max_position_embeddings)


_GDN_PARTS = ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "conv_dim", "conv_kernel_size")
_KDA_PARTS = ("num_heads", "head_dim", "conv_dim", "conv_kernel_size", "forget_gate")


def _is_gated_deltanet(linear: nn.Module) -> bool:
    """A Gated DeltaNet mixer (Qwen3.5 / Qwen3-Next `linear_attn`): the attributes its cache geometry comes from."""
    return all(hasattr(linear, part) for part in _GDN_PARTS)


def is_kimi_delta(mixer: nn.Module) -> bool:
    """A Kimi Delta Attention mixer (Kimi-Linear's linear layers, held as `self_attn`): per-channel decay
    (`forget_gate`), one conv over [q | k | v], as many key as value heads."""
    return all(hasattr(mixer, part) for part in _KDA_PARTS)


def linear_mixer(decoder_layer: nn.Module) -> nn.Module | None:
    """The decoder layer's linear-attention mixer, or None for an attention layer.

    Qwen3.5 / Qwen3-Next keep Gated DeltaNet as `linear_attn`; Kimi-Linear keeps Kimi Delta Attention in the
    `self_attn` slot its attention layers use. Both are called as `mixer(hidden_states=..., cache=...)`.
    """
    linear = getattr(decoder_layer, "linear_attn", None)
    if linear is not None:
        return linear
    attn = getattr(decoder_layer, "self_attn", None)
    return attn if attn is not None and is_kimi_delta(attn) else None


def _linear_objects(linear: nn.Module) -> tuple[RecurrentState, ConvWindow]:
    """Recurrent state [Hv, dk, dv] and conv window [C, K] of a linear-attention layer: GDN's C = 2 Hk dk + Hv dv,
    KDA's C = 3 H d with dk = dv = d (its state is fp32 in the engine whatever the model's dtype)."""
    if is_kimi_delta(linear):
        return (RecurrentState(n_heads=linear.num_heads, key_dim=linear.head_dim, value_dim=linear.head_dim),
                ConvWindow(channels=linear.conv_dim, kernel=linear.conv_kernel_size))
    return (RecurrentState(n_heads=linear.num_v_heads, key_dim=linear.head_k_dim, value_dim=linear.head_v_dim),
            ConvWindow(channels=linear.conv_dim, kernel=linear.conv_kernel_size))


def is_hybrid(layout: CacheLayout) -> bool:
    """Some layers hold a recurrent state (linear attention) beside layers that hold per-token objects."""
    return any(layer.attention == LINEAR for layer in layout.layers)


def _is_mla(attn: nn.Module) -> bool:
    """MLA attention projects one joint latent plus a shared rotary key (DeepSeek's `kv_a_proj_with_mqa`)."""
    return hasattr(attn, "kv_a_proj_with_mqa")


def _attention_kv(attn: nn.Module, config, layer_type: str, rope: tuple) -> AttentionKV:
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sliding = layer_type in ("sliding_attention", "chunked_attention")
    window = (getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)) if sliding else None
    return AttentionKV(
        attention=SLIDING if sliding else GLOBAL,
        window=window,
        n_kv_heads=attn.k_proj.out_features // head_dim,
        head_dim=head_dim,
        has_k_norm=getattr(attn, "k_norm", None) is not None,
        rope=rope,
    )


def _mla_objects(attn: nn.Module, config, rope: tuple, *, rotary: bool) -> tuple[CacheObjectKind, ...]:
    """MLA latent (+ the indexer's keys on a DSA layer). DeepSeek-V3.2 always rotates interleaved pairs;
    ``rotary`` False: a NoPE MLA (Kimi-Linear), whose shared key is cached as projected."""
    latent = MLALatent(
        kv_lora_rank=attn.kv_lora_rank,
        rope_dim=attn.qk_rope_head_dim,
        interleaved=bool(getattr(config, "rope_interleave", True)) and rotary,
        rope=rope if rotary else (),
        rotary=rotary,
    )
    indexer = getattr(attn, "indexer", None)
    if indexer is None:
        return (latent,)
    return latent, IndexerKeys(head_dim=indexer.head_dim, rope_dim=indexer.qk_rope_head_dim)


def _jsonable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None)))


def rotary_takes_layer_type(decoder: nn.Module) -> bool:
    """Gemma-3 computes RoPE per layer type (`rotary_emb(x, pos, layer_type)`); others take no type."""
    return "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters
