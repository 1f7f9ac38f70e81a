"""The switch runtime: hand a prefix from the source model to the target through a translated cache.

Geometry (paper §2, §4.8): the source holds the cache of x_{1:n-1}; the translator maps it into the target's
format, the target runs one decoding step on x_n (its first next-token distribution), then generates. The
reference path is the target re-prefilling x_{1:n} itself. With `context_len` k < n-1 (App. T) only x_{1:k}
is translated and the target prefills x_{k+1:n} on top of the translated cache.

Timings (seconds, wall clock, GPU work synchronised):
- translate_s: translator maps + writing the target cache (k-norm and RoPE at the target positions). The
  source capture is not counted: in deployment the source already holds its cache; `capture` stands in for
  reading it.
- first_step_s: the target's forward on x_{k+1:n} on top of the cache (one decoding step when k = n-1); for
  re-prefill, the forward over x_{1:n}.
- time_to_first_token_s: translate_s + first_step_s + picking the first token.
- decode_s: every later step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from translators.capture import Capture, capture, check_length
from translators.errors import ConfigError, PairMismatchError, PrefixTooLongError
from translators.generation import GenerationSettings, decode_from, sync
from translators.inject import decode_step
from translators.layout import CacheLayout
from translators.objects import cache_objects, engine_tensor, fill_cache_layer, object_width
from translators.points import check_point
from translators.stage1 import Side
from translators.translator import TOKEN_EMBEDDING, Translator

DEFAULT_POINT = "pre_norm"


@dataclass
class SwitchResult:
    """One generation after a switch (or on a reference path) and where its time went."""

    path: str  # "switch" | "reprefill"
    token_ids: list[int]  # generated tokens, a final stop id included
    text: str | None  # decoded generation when a tokenizer was given
    n_prefix: int  # n
    context_len: int  # tokens whose cache came from the source (0 on reference paths)
    stopped: str  # "stop_id" | "max_new_tokens"
    translate_s: float
    first_step_s: float
    decode_s: float
    time_to_first_token_s: float

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one (None when only one token was generated)."""
        later = len(self.token_ids) - 1
        return later / self.decode_s if later and self.decode_s > 0 else None


# --- Checks ---------------------------------------------------------------------------------------


def check_prefix(prefix_ids: torch.Tensor | Sequence[int], layout: CacheLayout, settings: GenerationSettings, who: str) -> torch.Tensor:
    """Validate a prefix and the generation budget for one model; returns the prefix as a [n] int64 tensor.

    Raises:
        ConfigError: empty prefix, batch > 1, or invalid settings (budget ≤ 0 ...).
        PrefixTooLongError: the prefix, or prefix + budget, exceeds the model's positions.
    """
    settings.check()
    ids = torch.as_tensor(prefix_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ConfigError(f"the prefix must be one sequence of token ids ([n] or [1, n]), got shape {list(ids.shape)}")
    n = int(ids.numel())
    check_length(layout, n, what=f"prefix ({who})")
    # The model reads the prefix plus every generated token except the last one.
    needed = n + settings.max_new_tokens - 1
    if needed > layout.max_positions:
        raise PrefixTooLongError(
            f"a prefix of {n} tokens plus {settings.max_new_tokens} new tokens needs {needed} positions but {who} "
            f"({layout.family}) reads at most {layout.max_positions}; lower max_new_tokens to at most "
            f"{layout.max_positions - n + 1} or shorten the prefix"
        )
    return ids


def check_translator_fits(translator: Translator | None, source: CacheLayout, target: CacheLayout) -> None:
    """Refuse a translator (or the identity, None) whose shapes do not fit this source/target pair.

    Raises:
        PairMismatchError: naming the dimension that differs.
    """
    if translator is None:
        if source.signature() != target.signature():
            raise PairMismatchError(
                "no translator given (identity) but the source and target caches differ "
                f"({source.family}, {source.n_layers} layers, width {source.kv_width} vs {target.family}, "
                f"{target.n_layers} layers, width {target.kv_width}); the identity only works between copies of one "
                "model: pass a translator fitted for this pair (`kvlingo fit`)"
            )
        return
    problems = _object_problems(translator, source, "source") + _object_problems(translator, target, "target")
    if translator.n_target_layers != target.n_layers:
        problems.append(f"it writes {translator.n_target_layers} target layers, the target has {target.n_layers}")
    if translator.source_layers() and max(translator.source_layers()) >= source.n_layers:
        problems.append(f"it reads source layer {max(translator.source_layers())}, the source has {source.n_layers}")
    if problems:
        raise PairMismatchError("the translator does not fit this model pair: " + "; ".join(problems))


def _object_problems(translator: Translator, layout: CacheLayout, role: str) -> list[str]:
    """What keeps `translator` from reading (role "source") or writing (role "target") the cache objects of
    `layout`: objects it lacks, objects it maps but the layout does not hold, and widths."""
    verb = "reads" if role == "source" else "writes"
    objects = {obj.name: obj for obj in cache_objects(layout)}
    # The token embedding comes from the target's vocabulary (`attach_token_identity` checks its width).
    used = tuple(o for o in translator.source_objects() if o != TOKEN_EMBEDDING) if role == "source" else translator.objects
    problems = []
    absent = [name for name in used if name not in objects]
    if absent:
        problems.append(f"it {verb} {', '.join(absent)}, the {role}'s cache holds {', '.join(objects)}")
        return problems
    unwritten = [name for name in objects if name not in translator.objects]
    if role == "target" and unwritten:
        problems.append(f"it does not write the target's {', '.join(unwritten)}")
    for name in translator.objects:
        expected = translator.widths(name)[0 if role == "source" else 1]
        names = tuple(o for o in translator.inputs[name] if o != TOKEN_EMBEDDING) if role == "source" else (name,)
        width = sum(object_width(objects[o], layout) for o in names)
        if width != expected and not (role == "source" and translator.token_identity and width < expected):
            problems.append(f"its {name} map {verb} {role} width {expected}, the {role}'s {'+'.join(names)} is {width}")
    return problems


def resolve_point(translator: Translator | None, point: str | None) -> str:
    """The capture point of the switch: the translator's own, or `point` (default pre_norm) for the identity.

    Raises:
        ConfigError: unknown point, or a point that contradicts the translator's.
    """
    if translator is None:
        return check_point(point or DEFAULT_POINT)
    if point is not None and point != translator.point:
        raise ConfigError(f"the translator acts at {translator.point!r}, not at the requested point {point!r}")
    return translator.point


# --- Translation ----------------------------------------------------------------------------------


def identity_translator(layout: CacheLayout, point: str = DEFAULT_POINT) -> Translator:
    """A dense ν=1 translator whose maps are identity matrices (layer ℓ reads layer ℓ).

    Translating with it reproduces the source cache exactly but costs what a real ν=1 map costs, which is what
    the speed benchmark should time for a model switched into a copy of itself.
    """
    objects = cache_objects(layout)
    widths = {obj.name: object_width(obj, layout) for obj in objects}
    assignment = {obj.name: {layer: (layer,) for layer in range(layout.n_layers)} for obj in objects}
    translator = Translator(assignment, widths, widths, check_point(point))
    for name in translator.objects:
        for layer in range(layout.n_layers):
            translator.set_weight(name, layer, torch.eye(widths[name]))
    return translator


def translate(
    translator: Translator | None, tensors: Mapping[str, Sequence[torch.Tensor]], token_ids: torch.Tensor | None = None
) -> dict[str, list[torch.Tensor]]:
    """Map source cache objects (name → list over source layers of [n_tokens, d_src]) to the target's.

    None is the identity: the tensors are returned as they are. token_ids: [n_tokens] target ids, read by a
    translator with token identity's `ids` variant.

    Returns:
        name → list over target layers of [n_tokens, d_tgt].
    """
    if translator is None:
        return {name: list(xs) for name, xs in tensors.items()}
    weight = next(translator.parameters())
    return translator.translate_objects({name: [x.to(weight.device) for x in xs] for name, xs in tensors.items()},
                                        token_ids)


def translated_cache(
    target: Side, translator: Translator | None, source_capture: Capture, point: str
) -> DynamicCache:
    """The target's cache of the captured tokens: translate, then apply the target's k-norm/RoPE. No grad.

    Equivalent to `build_cache(target, translate(...), point=point)`, but layer by layer: the engine cache
    copies each layer as it is filled, so feeding it one translated layer at a time keeps the switch's peak
    memory near the size of the cache it builds instead of twice that.

    Raises:
        ConfigError: translated shapes that do not match the target's layers.
    """
    positions = source_capture.positions
    device, dtype = target.model.device, next(target.model.parameters()).dtype
    objects = cache_objects(target.layout)
    sources = source_capture.objects if translator is None else translator.with_token_embedding(
        source_capture.objects, source_capture.token_ids)

    def layers():
        for layer in range(target.layout.n_layers):
            translated = _translate_layer(translator, sources, layer)
            expected = {obj.name: (len(positions), obj.width(target.layout.layers[layer])) for obj in objects}
            got = {name: tuple(translated[name].shape) if name in translated else None for name in expected}
            if got != expected:
                raise ConfigError(
                    f"target layer {layer}: expected translated objects of shapes {expected}, got {got}; use a "
                    "translator fitted for this pair"
                )
            # build_cache's order: cast to the model's dtype, then k-norm/RoPE at the target positions.
            yield [
                engine_tensor(obj, target.model, target.layout, layer, translated[obj.name].to(device, dtype),
                              point=point, positions=positions)
                for obj in objects
            ]

    with torch.no_grad():
        cache = DynamicCache(config=target.model.config)
        for layer, engine in enumerate(layers()):
            fill_cache_layer(cache, layer, objects, engine)
        return cache


def _translate_layer(translator: Translator | None, sources, layer: int) -> dict[str, torch.Tensor]:
    """Each cache object of one target layer (name → [n_tokens, d_tgt]) from a source capture's objects (with
    the token embedding when the maps read it)."""
    if translator is None:
        return {name: xs[layer] for name, xs in sources.items()}
    device = next(translator.parameters()).device
    # Only the source layers this target layer reads (moving nothing when they already share a device).
    return {
        name: translator.translate_layer(
            name, layer,
            {o: {s: sources[o][s].to(device) for s in translator.assignment[name][layer]} for o in translator.inputs[name]},
        )
        for name in translator.objects
    }


# --- Paths ----------------------------------------------------------------------------------------


def switch_generate(
    source: Side,
    target: Side,
    prefix_ids: torch.Tensor | Sequence[int],
    translator: Translator | None,
    settings: GenerationSettings | None = None,
    *,
    context_len: int | None = None,
    point: str | None = None,
    tokenizer: Any = None,
    source_capture: Capture | None = None,
) -> SwitchResult:
    """Switch from `source` to `target` after the prefix x_{1:n} and let the target generate.

    Args:
        prefix_ids: [n] token ids (same tokenizer for both models).
        translator: fitted for this pair, or None for the identity (source and target the same model).
        context_len: k, the number of leading tokens whose cache is translated (default n-1); the target reads
            x_{k+1:n} itself.
        point: capture point for the identity (default pre_norm); must match a translator's point if given.
        source_capture: the source's cache of x_{1:k} if it is already at hand (else it is captured here,
            untimed).
    Raises:
        ConfigError: empty prefix, budget ≤ 0, bad context_len, or a source_capture of another length/point.
        PrefixTooLongError: beyond either model's positions. PairMismatchError: translator of another shape.
    """
    settings = settings or GenerationSettings()
    ids = check_prefix(prefix_ids, target.layout, settings, "the target")
    check_length(source.layout, int(ids.numel()), what="prefix (the source)")
    check_translator_fits(translator, source.layout, target.layout)
    point = resolve_point(translator, point)
    k = _context_len(context_len, int(ids.numel()))
    with torch.no_grad():
        cache, translate_s = _switch_cache(source, target, ids[:k], translator, point, source_capture)
        t0 = time.perf_counter()
        logits = decode_step(target.model, cache, ids[k:], logits_to_keep=1)[-1]
        sync(target.model.device)
        first_step_s = time.perf_counter() - t0
        decoded = decode_from(target.model, cache, logits, settings)
    return _result("switch", decoded, tokenizer, ids, k, translate_s, first_step_s)


def reprefill_generate(
    target: Side, prefix_ids: torch.Tensor | Sequence[int], settings: GenerationSettings | None = None, *, tokenizer: Any = None
) -> SwitchResult:
    """The switch's reference: the target re-prefills x_{1:n} (its prefill is the time to first token).

    Raises:
        ConfigError: empty prefix or budget ≤ 0. PrefixTooLongError: beyond the target's positions.
    """
    return _prefill_generate("reprefill", target, prefix_ids, settings, tokenizer)


def _prefill_generate(path: str, side: Side, prefix_ids, settings: GenerationSettings | None, tokenizer: Any) -> SwitchResult:
    settings = settings or GenerationSettings()
    ids = check_prefix(prefix_ids, side.layout, settings, "the model")
    with torch.no_grad():
        cache = DynamicCache(config=side.model.config)
        t0 = time.perf_counter()
        logits = decode_step(side.model, cache, ids, logits_to_keep=1)[-1]
        sync(side.model.device)
        first_step_s = time.perf_counter() - t0
        decoded = decode_from(side.model, cache, logits, settings)
    return _result(path, decoded, tokenizer, ids, 0, 0.0, first_step_s)


def _context_len(context_len: int | None, n: int) -> int:
    """k in [0, n-1] (default n-1): the target must read at least x_n itself to predict the next token.

    Raises:
        ConfigError: k outside that range.
    """
    k = n - 1 if context_len is None else context_len
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n - 1:
        raise ConfigError(
            f"context_len must be an integer in [0, {n - 1}] for a prefix of {n} tokens (the target reads at least "
            f"the last prefix token itself), got {context_len!r}"
        )
    return k


def _switch_cache(
    source: Side, target: Side, ids: torch.Tensor, translator: Translator | None, point: str, held: Capture | None
) -> tuple[DynamicCache, float]:
    """The target cache of x_{1:k} translated from the source, and the (timed) translation seconds."""
    k = int(ids.numel())
    if k == 0:
        return DynamicCache(config=target.model.config), 0.0
    if held is None:
        held = capture(source.model, source.layout, ids, point)  # stands in for the cache the source holds
    elif held.n_tokens != k or held.point != point:
        raise ConfigError(
            f"the given source capture holds {held.n_tokens} tokens at {held.point!r} but the switch translates "
            f"{k} tokens at {point!r}; capture x_1..x_{k} at {point!r}"
        )
    sync(target.model.device)
    t0 = time.perf_counter()
    cache = translated_cache(target, translator, held, point)
    sync(target.model.device)
    return cache, time.perf_counter() - t0


def _result(path, decoded, tokenizer, ids, k, translate_s, first_step_s) -> SwitchResult:
    text = tokenizer.decode(decoded.token_ids, skip_special_tokens=True) if tokenizer is not None else None
    return SwitchResult(
        path=path,
        token_ids=decoded.token_ids,
        text=text,
        n_prefix=int(ids.numel()),
        context_len=k,
        stopped=decoded.stopped,
        translate_s=translate_s,
        first_step_s=first_step_s,
        decode_s=decoded.decode_s,
        time_to_first_token_s=translate_s + first_step_s + decoded.first_pick_s,
    )
