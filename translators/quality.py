"""A calibrated quality floor for a translator: per-layer attention-output cosine on held-out samples.

The serving gate must decide between loading a translated cache and re-prefilling before it loads anything, knowing
only how many tokens it would load. This module measures, at fit time, how faithfully the target *reads* the
translated cache, records that as a function of prefix length, and calibrates a floor against how often the target
still predicts what it predicts over its own cache; `quality_verdict` is the gate's lookup.

The metric (per target layer ℓ, per held-out sample): the target reads the prefix x_{1:n} and the continuation
y_{1:m}. Its own forward over x_{1:n} y_{1:m-1} gives, at each layer, the input of the layer's token mixer (the
attention module, or a linear-attention mixer) at the m positions that predict y; these fix the queries. The target
then reads x_n y_{1:m-1} once more on top of the translated cache of x_{1:n-1}, with every mixer's input replaced by
that native input, so each layer sees the native queries (and native keys/values for the m new tokens) and differs
from the native run only in the cache it attends to: errors of earlier layers do not compound into later ones. The
cosine between the two mixer outputs (o_proj's output, [m, d_model]) is taken per position and averaged over the m
positions. Identity translation gives 1 on every layer. One forward of the target's own, and two over the m
continuation tokens on the translated cache (one as above, one unmodified for the agreement below) per sample.

Retained accuracy (what the floor is calibrated against): per sample, the share of the m continuation positions at
which the target's greedy (argmax) next token over the translated cache, read normally, equals its greedy token over
its own cache (teacher-forced, so every position is scored on the same history).

The record (JSON, in the artifact manifest under fit.quality):

    {"metric": "attention_output_cosine", "agreement_level": 0.9, "floor": 0.97,
     "per_layer": [mean cosine of target layer ℓ over samples, ...],
     "buckets": [{"max_tokens": 64, "n": 5, "cosine": 0.985, "agreement": 0.93}, ...],   # ascending max_tokens
     "samples": [{"tokens": 57, "cosine": 0.981, "agreement": 0.92}, ...],
     "n_samples": 12}

`tokens` is the number of cached (translated) tokens the target read, n − 1 (the gate's n_load); a sample's
`cosine` is its minimum over layers (the weakest layer bounds what the target reads correctly). A bucket holds the
samples with previous max_tokens < tokens ≤ max_tokens (powers of two), its cosine and agreement are means over them.

Floor (calibration rule): sort the held-out samples by cosine, highest first; the floor is the lowest cosine c such
that the samples with cosine ≥ c agree with the native greedy tokens on at least `agreement_level` of positions on
average (the largest such top-k set). When even the best samples agree less than that, the floor is 1.0, which
only exact translation reaches: every request falls back. The verdict compares the bucket of a request's prefix
length against the floor; a prefix longer than every calibrated one falls back too (nothing was measured there).

Pure torch: models, samples and translators in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from translators.capture import MODEL_STATE_LOCK, capture
from translators.continuation import check_sample
from translators.cross import CrossSample, mixed_cache, source_capture, translated_tensors
from translators.errors import ConfigError
from translators.layout import decoder_of
from translators.stage1 import Side
from translators.switch import resolve_point, translated_cache
from translators.translator import Translator

METRIC = "attention_output_cosine"
# Share of continuation positions whose greedy token must survive translation, on average, above the floor.
AGREEMENT_LEVEL = 0.9


@dataclass
class NativeReference:
    """What the target's own forward gives for one sample (does not depend on the translator).

    inputs[ℓ]: [1, m, d_model] the input of layer ℓ's token mixer at the m positions predicting y.
    outputs[ℓ]: [m, d_model] that mixer's output there.
    argmax: [m] the target's greedy next token at those positions.
    """

    inputs: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    argmax: torch.Tensor


@dataclass
class SampleQuality:
    """One held-out sample. cosine: [n_layers] mean over the m positions of the per-position cosine of each layer's
    mixer output (translated vs native cache); tokens: cached tokens the target read; agreement in [0, 1]."""

    tokens: int
    cosine: torch.Tensor
    agreement: float

    @property
    def min_cosine(self) -> float:
        return float(self.cosine.min())


def mixers(model: nn.Module) -> dict[int, nn.Module]:
    """Each decoder layer's token mixer: its `linear_attn` (hybrids) or its `self_attn`."""
    out = {}
    for i, layer in enumerate(decoder_of(model).layers):
        module = getattr(layer, "linear_attn", None)
        module = getattr(layer, "self_attn", None) if module is None else module
        if module is None:
            raise ConfigError(f"layer {i} of the target has no self_attn/linear_attn module to measure")
        out[i] = module
    return out


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _target_ids(sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's prefix ids [n], continuation ids [m]) of a same-tokenizer pair or a cross-tokenizer sample."""
    if isinstance(sample, CrossSample):
        prefix, continuation = sample.target_ids, sample.continuation_ids
    else:
        prefix, continuation = sample
    check_sample(prefix, continuation)
    return prefix, continuation


def native_reference(target: Side, sample) -> NativeReference:
    """The target's own forward over x_{1:n} y_{1:m-1}, with each mixer's input and output kept at the last m
    positions (the queries predicting y_1..y_m), and its greedy tokens there.

    Args:
        sample: (prefix ids [n], continuation ids [m]) or a CrossSample (the target's rendering is read).
    Raises:
        ConfigError: prefix < 2 tokens or empty continuation.
    """
    prefix, continuation = _target_ids(sample)
    m = continuation.numel()
    model = target.model
    ids = torch.cat([prefix, continuation[:-1]]).view(1, -1).to(model.device)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    handles = []

    def keep(i: int):
        def pre(_module, args, kwargs):
            inputs[i] = _hidden_states(args, kwargs)[:, -m:].detach().clone()  # [1, m, d_model]

        def post(_module, _args, _kwargs, output):
            outputs[i] = _output(output)[0, -m:].detach().clone()  # [m, d_model]

        return pre, post

    with MODEL_STATE_LOCK, torch.no_grad():
        try:
            for i, module in mixers(model).items():
                pre, post = keep(i)
                handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                            module.register_forward_hook(post, with_kwargs=True)]
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=m).logits[0]  # [m, vocab]
        finally:
            for handle in handles:
                handle.remove()
    return NativeReference(inputs, outputs, logits.argmax(-1).cpu())


def _translated_runs(source: Side, target: Side, sample, translator: Translator | None):
    """Captures the source once; returns a function giving a fresh translated cache of the sample's cached prefix
    (decoding extends a cache in place), the ids the target reads on top of it (x_n y_{1:m-1}, [1, m]), their
    position ids ([1, m]), and the number of cached tokens."""
    prefix, continuation = _target_ids(sample)
    model = target.model
    if isinstance(sample, CrossSample):
        if translator is None:
            raise ConfigError("a cross-tokenizer sample needs a translator (there is no identity across tokenizers)")
        tensors = translated_tensors(translator, source_capture(source, sample, translator.point), sample)

        def fresh():  # translated content at its assigned positions, boilerplate prefilled by the target
            return mixed_cache(model, target.layout, sample, tensors, translator.point)
    else:
        point = resolve_point(translator, None)
        held = capture(source.model, source.layout, prefix[:-1], point)

        def fresh():
            return translated_cache(target, translator, held, point)
    start = prefix.numel() - 1
    ids = torch.cat([prefix[-1:], continuation[:-1]]).view(1, -1).to(model.device)
    positions = torch.arange(start, start + ids.shape[1], device=model.device).view(1, -1)
    return fresh, ids, positions, start


def sample_quality(
    source: Side, target: Side, sample, translator: Translator | None, reference: NativeReference | None = None,
) -> SampleQuality:
    """Per-layer attention-output cosine and greedy agreement of one held-out sample (see the module docstring).

    Args:
        sample: (prefix ids [n], continuation ids [m]) of a same-tokenizer pair, or a CrossSample.
        translator: fitted for the pair; None is the identity (source and target copies of one model).
        reference: `native_reference(target, sample)` when already at hand (it does not depend on the translator).
    Raises:
        ConfigError: prefix < 2 tokens, empty continuation, a cross-tokenizer sample without a translator.
    """
    reference = reference or native_reference(target, sample)
    model = target.model
    with torch.no_grad():
        fresh, ids, positions, tokens = _translated_runs(source, target, sample, translator)
        logits = model(input_ids=ids, cache=fresh(), use_cache=True, position_ids=positions).logits[0]  # [m, vocab]
        agreement = float((logits.argmax(-1).cpu() == reference.argmax).float().mean())
        cache = fresh()
    outputs: dict[int, torch.Tensor] = {}
    handles = []

    def substitute(i: int):
        def pre(_module, args, kwargs):
            native = reference.inputs[i]
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": native}
            return (native, *args[1:]), kwargs

        def post(_module, _args, _kwargs, output):
            outputs[i] = _output(output)[0].detach()  # [m, d_model]

        return pre, post

    with MODEL_STATE_LOCK, torch.no_grad():
        try:
            for i, module in mixers(model).items():
                pre, post = substitute(i)
                handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                            module.register_forward_hook(post, with_kwargs=True)]
            model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
    cosine = torch.stack([
        F.cosine_similarity(outputs[i].float(), reference.outputs[i].float(), dim=-1).mean()  # over the m positions
        for i in sorted(reference.outputs)
    ]).cpu()  # [n_layers]
    return SampleQuality(tokens=tokens, cosine=cosine, agreement=agreement)


def measure(source: Side, target: Side, samples: Sequence, translator: Translator | None) -> list[SampleQuality]:
    """`sample_quality` of every held-out sample.

    Raises:
        ConfigError: no samples (and what `sample_quality` raises).
    """
    if not samples:
        raise ConfigError("the quality record needs held-out samples: hold out at least one conversation")
    return [sample_quality(source, target, sample, translator) for sample in samples]


def bucket_of(tokens: int) -> int:
    """The bucket bound of a prefix of `tokens` cached tokens: the smallest power of two ≥ tokens (≥ 1)."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def calibrate_floor(samples: Sequence[tuple[float, float]], level: float = AGREEMENT_LEVEL) -> float:
    """The lowest cosine c such that the samples with cosine ≥ c reach mean agreement ≥ `level`; 1.0 when even the
    highest-cosine samples fall short (only exact translation passes then).

    Args:
        samples: (cosine, agreement) per held-out sample.
    Raises:
        ConfigError: no samples or a level outside (0, 1].
    """
    if not samples:
        raise ConfigError("calibrating a floor needs at least one held-out sample")
    if not 0 < level <= 1:
        raise ConfigError(f"the agreement level must lie in (0, 1], got {level}")
    ordered = sorted(samples, key=lambda s: -s[0])
    floor, total = 1.0, 0.0
    for k, (cosine, agreement) in enumerate(ordered, start=1):
        total += agreement
        # Samples tied on cosine enter together: a floor at c admits all of them.
        if (k == len(ordered) or ordered[k][0] < cosine) and total / k >= level:
            floor = cosine
    return floor


def quality_record(results: Sequence[SampleQuality], level: float = AGREEMENT_LEVEL) -> dict[str, Any]:
    """The JSON-able record of the module docstring, from `measure`'s results.

    Raises:
        ConfigError: no results, a level outside (0, 1].
    """
    if not results:
        raise ConfigError("the quality record needs held-out samples: hold out at least one conversation")
    per_layer = torch.stack([r.cosine for r in results]).mean(0)  # [n_layers]
    rows = [{"tokens": r.tokens, "cosine": r.min_cosine, "agreement": r.agreement} for r in results]
    buckets = []
    for bound in sorted({bucket_of(r["tokens"]) for r in rows}):
        inside = [r for r in rows if bucket_of(r["tokens"]) == bound]
        buckets.append({"max_tokens": bound, "n": len(inside),
                        "cosine": sum(r["cosine"] for r in inside) / len(inside),
                        "agreement": sum(r["agreement"] for r in inside) / len(inside)})
    return {
        "metric": METRIC,
        "agreement_level": level,
        "floor": calibrate_floor([(r["cosine"], r["agreement"]) for r in rows], level),
        "per_layer": [float(c) for c in per_layer],
        "buckets": buckets,
        "samples": rows,
        "n_samples": len(rows),
    }


def record_quality(source: Side, target: Side, samples: Sequence, translator: Translator | None,
                   level: float = AGREEMENT_LEVEL) -> dict[str, Any]:
    """`quality_record(measure(...))`: what the fit stores with a translator (fit.quality in the manifest)."""
    return quality_record(measure(source, target, samples, translator), level)


def quality_verdict(quality: dict[str, Any] | None, n_load: int, floor: float | None = None) -> str | None:
    """The gate's check before loading `n_load` translated tokens: None when the recorded quality clears the floor,
    else the reason to fall back to re-prefill.

    Args:
        quality: the manifest's fit.quality record, or None (an artifact fitted without one).
        n_load: the number of cached tokens the request would load.
        floor: overrides the recorded floor; None uses it.
    Returns:
        None: the bucket of n_load (the smallest recorded max_tokens ≥ n_load) has cosine ≥ floor, or there is
        neither a record nor a floor to hold it to. A reason string: the bucket's cosine is below the floor, n_load is
        beyond every recorded bucket, or a floor was asked of an artifact that records no quality.
    Raises:
        ConfigError: a negative n_load, or a record without buckets.
    """
    if isinstance(n_load, bool) or int(n_load) != n_load or n_load < 0:
        raise ConfigError(f"n_load must be a non-negative number of tokens, got {n_load!r}")
    if quality is None:
        if floor is None:
            return None
        return (f"a quality floor of {floor:g} was asked for, but this translator records no quality (fitted before "
                "quality records existed): re-fit it, or serve it without a floor")
    buckets = sorted(quality.get("buckets") or [], key=lambda b: b["max_tokens"])
    if not buckets:
        raise ConfigError("the translator's quality record holds no buckets")
    floor = quality["floor"] if floor is None else floor
    bucket = next((b for b in buckets if n_load <= b["max_tokens"]), None)
    if bucket is None:
        return (f"a prefix of {n_load} tokens is longer than every held-out prefix the translator's quality was "
                f"measured on (up to {buckets[-1]['max_tokens']} tokens)")
    if bucket["cosine"] < floor:
        return (f"the recorded {quality.get('metric', METRIC)} for prefixes of up to {bucket['max_tokens']} tokens is "
                f"{bucket['cosine']:.4f}, below the floor {floor:.4f}")
    return None
