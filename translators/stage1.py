"""Stage 1: paired capture → streaming Gram statistics → layer assignment → closed-form maps → diagnostics.

Everything here takes models, layouts and token tensors; nothing loads, tracks or orchestrates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from translators.assignment import (
    all_candidates,
    check_assignment_name,
    corresponding_types,
    greedy,
    r2_assignment,
    relative_depth,
)
from translators.capture import MODEL_STATE_LOCK, capture
from translators.continuation import cache_logits, kl_per_position, no_prefix_logits, teacher_logits
from translators.errors import ConfigError
from translators.gram import GramStats
from translators.inject import write_cache
from translators.layout import CacheLayout
from translators.objects import CacheObject, cache_objects, input_width, object_inputs, object_width, same_kinds
from translators.solve import fit_map, relative_residual
from translators.token_identity import TokenIdentity, with_tokens
from translators.translator import Translator, source_features


@dataclass(frozen=True)
class Side:
    """One model of the pair as stage 1 needs it."""

    model: nn.Module
    layout: CacheLayout


# App. H: more source layers per target layer buy back retrieval, at a translation cost ∝ ν. Measured on the embedded
# pair (held-out recall, 60 items, distilled cache, fit defaults otherwise): ν=1 0.83/0.77, ν=2 0.867/0.933 for
# tiny-l→tiny-s / tiny-s→tiny-l, against 0.95/0.967 for the target's own prefill. ν=4 recalled 0.85-0.88 but made
# stage 2 unstable at lr 3e-3 (worse than its closed form on tiny-s→tiny-l).
DEFAULT_NU = 2


def default_nu(source: CacheLayout, target: CacheLayout) -> int:
    """ν when the user sets none: DEFAULT_NU, or fewer when some target layer has fewer source layers of its
    attention type (a 3-layer source, or Gemma's few global layers) to read."""
    src_types, tgt_types = matched_attention_types(source, target)
    fewest = min(len(c) for c in all_candidates(source.n_layers, target.n_layers, src_types, tgt_types).values())
    return min(DEFAULT_NU, fewest)


def candidate_layers(source: CacheLayout, target: CacheLayout, method: str, nu: int) -> dict[int, tuple[int, ...]]:
    """Source layers whose statistics are accumulated per target layer.

    Relative depth needs only its band; greedy and R² choose among every source layer of the same attention
    type, from the same statistics (no second pass over the data).

    Raises:
        ConfigError: unknown method (with suggestion), ν < 1 or larger than the source depth.
    """
    check_assignment_name(method)
    src_types, tgt_types = matched_attention_types(source, target)
    if method == "depth":
        return relative_depth(source.n_layers, target.n_layers, nu, src_types, tgt_types)
    if nu > source.n_layers:
        raise ConfigError(f"ν = {nu} is larger than the source depth ({source.n_layers} layers)")
    return all_candidates(source.n_layers, target.n_layers, src_types, tgt_types)


def matched_attention_types(source: CacheLayout, target: CacheLayout) -> tuple[list[str] | None, list[str] | None]:
    """`assignment.corresponding_types` of the two layouts' attention types (None, None: types are ignored)."""
    return corresponding_types(source.attention_types, target.attention_types)


def empty_stats(
    source: CacheLayout,
    target: CacheLayout,
    candidates: dict[int, tuple[int, ...]],
    objects: tuple[CacheObject, ...] | None = None,
    *,
    token_width: int = 0,
) -> dict[str, GramStats]:
    """Zero statistics per target cache object, keyed by object name: the source side is what that object's
    map reads per source layer (`object_inputs`: the same object, or the source's attention objects side by
    side; with `token_width`, token identity's features, summed once for all source layers), the target side the
    object's width.

    Args:
        objects: the target objects to fit; default the target's `cache_objects` (GQA: keys, values).
        token_width: the target's embedding width when the maps append token identity, else 0.
    Raises:
        UnsupportedModelError: an object's width differs across layers.
    """
    objects = cache_objects(target) if objects is None else objects
    inputs = object_inputs(source, target, tuple(obj.name for obj in objects))
    readable = {obj.name: obj for obj in (*cache_objects(source), *objects)}
    return {
        obj.name: GramStats.empty(
            obj, candidates, input_width(source, tuple(readable[n] for n in inputs[obj.name])),
            object_width(obj, target), d_tok=token_width)
        for obj in objects
    }


WEIGHTINGS = ("uniform", "attention")


def attention_weights(target: Side, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """App. O's weights ā_i: the attention prefix position i receives from the continuation's queries, averaged
    over heads and queries (eq. 3.4) and, since one weight vector serves every layer's statistics, over layers.

    The target reads x_{1:n} y_{1:m-1}; the queries are the m positions that predict y. Returns [n] ≥ 0, each
    entry ≤ 1 and their sum ≤ 1 (the rest of the attention goes to continuation positions).
    """
    ids = torch.cat([prefix_ids, continuation_ids[:-1]]).view(1, -1).to(target.model.device)
    n, m = prefix_ids.numel(), continuation_ids.numel()
    with MODEL_STATE_LOCK:  # the switch to eager must not leak into captures on other threads
        previous = target.model.config._attn_implementation
        target.model.set_attn_implementation("eager")  # fused kernels do not return attention probabilities
        try:
            with torch.no_grad():
                attentions = target.model(input_ids=ids, use_cache=False, output_attentions=True, logits_to_keep=1).attentions
        finally:
            target.model.set_attn_implementation(previous)
    # Each: [1, heads, n+m-1, n+m-1]; rows n-1.. are the queries predicting y_1..y_m, columns :n the prefix.
    per_layer = [a[0, :, n - 1 : n - 1 + m, :n].float().mean(dim=(0, 1)) for a in attentions]
    return torch.stack(per_layer).mean(0).cpu()


def accumulate_pair(
    stats: dict[str, GramStats],
    source: Side,
    target: Side,
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
    point: str,
    *,
    weighting: str = "uniform",
    on_sample: Callable[[int], None] | None = None,
    objects: tuple[CacheObject, ...] | None = None,
    token_identity: TokenIdentity | None = None,
) -> dict[str, GramStats]:
    """Add the paired captures of each sample's prefix ([n] token ids, same tokenizer) to `stats` (in place).

    weighting: "uniform" (the Frobenius fit of eq. 3.2) or "attention" (App. O's attention-weighted norm; the
    continuation is read only to weight the prefix positions).
    objects: the cache objects `stats` holds (by name); default the target's `cache_objects`.
    token_identity: append the target's embedding of each token's id (decoded by the codebook, or the prefix
        itself for the ids variant) to every map's input, as the translator will at inference.

    Raises:
        ConfigError: unknown weighting, or `stats` not keyed by the objects' names.
        NonFiniteError: a capture holds NaN/Inf (model and layer named).
    """
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"unknown weighting {weighting!r}; choose from {', '.join(WEIGHTINGS)}")
    objects = cache_objects(target.layout) if objects is None else objects
    if set(stats) != {obj.name for obj in objects}:
        raise ConfigError(f"statistics of {sorted(stats)} cannot accumulate objects {[obj.name for obj in objects]}")
    inputs = object_inputs(source.layout, target.layout, tuple(obj.name for obj in objects))
    # Same kinds: the source is captured with the same adapters (`objects` may add one of the caller's own).
    source_objects = objects if same_kinds(source.layout, target.layout) else cache_objects(source.layout)
    with torch.no_grad():
        for prefix, continuation in samples:
            src = capture(source.model, source.layout, prefix, point, source_objects)
            tgt = capture(target.model, target.layout, prefix, point, objects)
            src.check_finite("source")
            tgt.check_finite("target")
            weights = attention_weights(target, prefix, continuation) if weighting == "attention" else None
            tokens = token_identity.embed(token_identity.ids(src.objects, prefix)) if token_identity else None
            for obj in objects:
                features = [source_features(src.objects, inputs[obj.name], s) for s in range(source.layout.n_layers)]
                stats[obj.name].accumulate(features, tgt.objects[obj.name], weights, tokens)
            if on_sample:
                on_sample(prefix.numel())
    return stats


def assign_layers(stats: dict[str, GramStats], source: CacheLayout, target: CacheLayout, method: str, nu: int) -> dict:
    """The assignment {object name: {target layer: source layers}} for the objects `stats` holds; each object
    (keys, values) is ranked separately (greedy, R²)."""
    if method == "depth":
        band = relative_depth(source.n_layers, target.n_layers, nu, *matched_attention_types(source, target))
        return {name: band for name in stats}
    choose = greedy if method == "greedy" else r2_assignment
    return {name: choose(object_stats, nu) for name, object_stats in stats.items()}


def solve_translator(
    stats: dict[str, GramStats],
    assignment: dict,
    source: CacheLayout,
    target: CacheLayout,
    point: str,
    *,
    ridge: float = 0.0,
    head_wise: bool = False,
    token_identity: str | None = None,
) -> Translator:
    """Closed-form maps (eigen pseudo-inverse, or ridge when `ridge` > 0) for every target layer and object.

    Each object's map reads what `object_inputs(source, target)` names; objects of different widths (MLA's
    latent and rotary key) get maps of their own shapes.

    Raises:
        ConfigError: head-wise maps for a cache without attention heads (MLA).
    """
    d_src = _one_or_each({name: stats[name].d_in for name in assignment})
    d_tgt = _one_or_each({name: stats[name].d_tgt for name in assignment})
    inputs = object_inputs(source, target, tuple(assignment))
    translator = Translator(assignment, d_src, d_tgt, point, with_tokens(inputs) if token_identity else inputs,
                            token_identity)
    heads = {}
    if head_wise:
        if token_identity:
            raise ConfigError("head-wise maps cannot read token identity (it belongs to no head); drop one of them")
        if not (source.layers[0].objects[0].kind == target.layers[0].objects[0].kind == "attention_kv"):
            raise ConfigError("head-wise maps need attention heads on both sides (GQA K/V); MLA caches have none")
        heads = {"n_heads_src": source.layers[0].kv.n_kv_heads, "n_heads_tgt": target.layers[0].kv.n_kv_heads}
    for name in translator.objects:
        for t, sources in assignment[name].items():
            weight = fit_map(stats[name], t, sources, ridge=ridge, head_wise=head_wise, **heads)
            translator.set_weight(name, t, weight)
    return translator


def zero_translator(source: CacheLayout, target: CacheLayout, band: dict, point: str) -> Translator:
    """A translator of zero maps with this pair's shapes, every target object reading the source layers `band`
    ({target layer: source layers}); what a cost measurement needs when values do not matter."""
    inputs = object_inputs(source, target)
    by_name = {obj.name: obj for obj in cache_objects(source)}
    objects = cache_objects(target)
    d_src = {obj.name: input_width(source, tuple(by_name[n] for n in inputs[obj.name])) for obj in objects}
    d_tgt = {obj.name: object_width(obj, target) for obj in objects}
    return Translator({obj.name: band for obj in objects}, _one_or_each(d_src), _one_or_each(d_tgt), point, inputs)


def _one_or_each(widths: dict[str, int]) -> int | dict[str, int]:
    """One int when every object has the same width (the GQA manifests' form), else the per-object mapping."""
    return next(iter(widths.values())) if len(set(widths.values())) == 1 else widths


def heldout_r2(stats: dict[str, GramStats], translator: Translator) -> dict[str, list[float]]:
    """R² = 1 − ‖Y − X T‖²/‖Y‖² per object and target layer, on statistics of held-out samples."""
    return {
        name: [
            1.0 - relative_residual(stats[name], t, sources, translator.weight(name, t).detach())
            for t, sources in sorted(translator.assignment[name].items())
        ]
        for name in translator.objects
    }


def random_like(translator: Translator, seed: int = 0) -> Translator:
    """Control `random_map`: Gaussian maps of the same shapes and Frobenius norms as `translator`'s."""
    generator = torch.Generator().manual_seed(seed)
    control = Translator(translator.assignment, translator.d_src, translator.d_tgt, translator.point, translator.inputs,
                         translator.token_identity)
    control.token_module = translator.token_module
    for name, weight in translator.maps.items():
        noise = torch.randn(weight.shape, generator=generator)
        control.maps[name].data.copy_(noise * (weight.detach().norm() / noise.norm()))
    return control


@dataclass
class ValidationKL:
    """Mean KL(target native ‖ condition) per continuation token, averaged over samples (nats)."""

    mean: float
    se: float  # standard error over samples
    first_token: float  # KL at the first continuation token only, mean over samples
    n: int
    # Each sample's mean KL, in sample order: comparisons of two translators on the same samples pair them.
    per_sample: tuple[float, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, means: Sequence[float], firsts: Sequence[float]) -> "ValidationKL":
        """From each sample's mean KL and first-token KL (at least one sample)."""
        n = len(means)
        mean = sum(means) / n
        var = sum((x - mean) ** 2 for x in means) / (n - 1) if n > 1 else 0.0
        return cls(mean=mean, se=math.sqrt(var / n), first_token=sum(firsts) / n, n=n, per_sample=tuple(means))

    def summary(self) -> dict[str, float | int]:
        """mean, se, first_token and n (what run summaries record; the per-sample values stay out)."""
        return {"mean": self.mean, "se": self.se, "first_token": self.first_token, "n": self.n}


# What one ReferenceMemo keeps: a fit's 120 validation and 60 selection conversations on the embedded pair take about
# 0.2 GB; a 262k-token vocabulary's continuation logits run past it, and what does not fit is recomputed at each call.
REFERENCE_MEMO_BYTES = 1 << 30


class ReferenceMemo:
    """The translator-independent parts of validation scores, kept between calls that score the same samples.

    A fit scores its validation conversations for the closed form, both controls, every `eval_every` stage-2 steps
    and the returned translator, and its selection conversations once per checkpoint: about 2,000 scorings of 180
    conversations with the defaults. The target's own continuation logits and the source's capture of each prefix
    are the same every time (frozen models, same inputs, no-grad), so the kept tensors are bit-identical to
    recomputed ones and each scoring runs only the translation and the target's continuation. Samples are
    recognised by the identity of their tensors (the memo holds them, so an identity is never reused).
    """

    def __init__(self, budget_bytes: int = REFERENCE_MEMO_BYTES):
        self.budget_bytes = budget_bytes
        self._entries: dict[tuple, tuple[tuple, object]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        """How many values are kept."""
        return len(self._entries)

    def get(self, what: str, sample, compute: Callable[[], object]):
        """The kept value of `what` (e.g. "teacher", "capture:pre_norm") for `sample`, or `compute()`, kept while the
        memo stays under its budget. `sample`: a (prefix, continuation) pair or a cross-tokenizer sample."""
        held = tuple(sample) if isinstance(sample, tuple) else (sample,)
        key = (what, *map(id, held))
        if key in self._entries:
            return self._entries[key][1]
        value = compute()
        size = _nbytes(value)
        if self._bytes + size <= self.budget_bytes:
            self._entries[key] = (held, value)
            self._bytes += size
        return value


def _nbytes(value) -> int:
    """Bytes of a tensor or of a capture's tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(t.numel() * t.element_size() for tensors in value.objects.values() for t in tensors)


def validation_kl(
    source: Side,
    target: Side,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    translator: Translator | None,
    *,
    condition: str = "translated",
    memo: ReferenceMemo | None = None,
) -> ValidationKL:
    """KL of the target's continuation predictions against its own prefill, over (prefix, continuation) pairs.

    condition: "translated" (the translator applied to the source's cache of x_{1:n-1}) or "empty_prefix"
    (the target with no prefix cache at all). memo: keeps the target's own logits and the source's captures for
    the next call on the same samples (a fresh one per call when None).

    Raises:
        ConfigError: empty validation set, unknown condition, or a zero-length continuation.
    """
    if not samples:
        raise ConfigError("empty validation set: hold out at least one conversation (raise the sample count)")
    if condition not in ("translated", "empty_prefix"):
        raise ConfigError(f"unknown condition {condition!r}")
    memo = ReferenceMemo(budget_bytes=0) if memo is None else memo
    means, firsts = [], []
    with torch.no_grad():
        for sample in samples:
            prefix, continuation = sample
            teacher = memo.get("teacher", sample, lambda: teacher_logits(target.model, prefix, continuation))
            if condition == "empty_prefix":
                student = no_prefix_logits(target.model, prefix, continuation)
            else:
                cap = memo.get(f"capture:{translator.point}", sample,
                               lambda: capture(source.model, source.layout, prefix[:-1], translator.point))
                cache = write_cache(target.model, target.layout, translator.translate_objects(cap.objects, cap.token_ids),
                                    point=translator.point)
                student = cache_logits(target.model, cache, prefix, continuation)
            kl = kl_per_position(teacher, student)
            means.append(kl.mean().item())
            firsts.append(kl[0].item())
    return ValidationKL.of(means, firsts)
