"""The paired conditions every evaluation scores the same items under.

- `target_native`: the target prefills the whole context itself (the upper anchor).
- `source_native`: the source model answers from its own cache (the model we switch away from).
- `translated`: the target decodes from the translator's translation of the source's cache of context[:-1],
  then reads context[-1] itself — exactly the geometry of `translators.continuation.student_logits`, so the
  quantity benchmarked is the quantity stage 2 trains.
- `empty_prefix`: the floor: the target reads nothing of context[:-1] (no cache at all), only context[-1] —
  the geometry of `translators.continuation.no_prefix_logits` (the fit's `empty_prefix` control). A translated
  cache that scores like this carries nothing.

Source and target of a translated condition share one tokenizer (cross-tokenizer pairs are aligned elsewhere);
every function here takes token ids, never text. A pair with a hybrid side (recurrent states, `kvlingo fit`'s
hybrid artifacts) is translated by its `translators.hybrid.HybridTranslator` into the decoder's full hybrid cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from translators.capture import capture, capture_hybrid, check_length
from translators.continuation import cache_logits
from translators.errors import ConfigError
from translators.generation import GenerationSettings, decode_from
from translators.hybrid import HybridTranslator, check_hybrid_translator_fits
from translators.inject import decode_step, write_cache, write_hybrid_cache
from translators.layout import is_hybrid
from translators.stage1 import Side
from translators.switch import check_translator_fits
from translators.translator import Translator

TARGET_NATIVE = "target_native"
SOURCE_NATIVE = "source_native"
TRANSLATED = "translated"
EMPTY_PREFIX = "empty_prefix"
CONDITIONS = (TARGET_NATIVE, SOURCE_NATIVE, TRANSLATED, EMPTY_PREFIX)
NATIVE = (TARGET_NATIVE, SOURCE_NATIVE)
# Conditions whose decoder reads token ids itself (no translated cache): no source, no translator.
UNTRANSLATED = (*NATIVE, EMPTY_PREFIX)
# The identity "translator" hands the source's keys through unchanged; any point is exact because build_cache
# re-applies the (identical) model's own k-norm and RoPE from it. pre_norm is the platform default.
IDENTITY_POINT = "pre_norm"


@dataclass(frozen=True)
class Condition:
    """One way of answering: which model decodes, and (translated only) from whose translated cache.

    Args:
        name: one of CONDITIONS.
        decoder: the model that produces the logits (the target, or the source for `source_native`).
            `empty_prefix` decoders read only the context's last token.
        source: the model whose cache is translated (`translated` only).
        translator: maps source captures to decoder keys/values (a `HybridTranslator` when either side is a
            hybrid); None with `translated` means identity (source and decoder must then have equal cache
            layouts, i.e. be the same model, and not a hybrid).
    Raises:
        ConfigError: unknown name, a native condition given a source or translator, a translated condition
            without a source, or a translator/identity that does not fit the two layouts.
    """

    name: str
    decoder: Side
    source: Side | None = None
    translator: Translator | HybridTranslator | None = None

    def __post_init__(self) -> None:
        if self.name not in CONDITIONS:
            raise ConfigError(f"unknown condition {self.name!r}; choose one of {', '.join(CONDITIONS)}")
        if self.name in UNTRANSLATED:
            if self.source is not None or self.translator is not None:
                raise ConfigError(
                    f"condition {self.name!r} reads no translated cache: pass no source and no translator"
                )
            return
        if self.source is None:
            raise ConfigError(
                "condition 'translated' needs the source side whose cache is translated (source=Side(...))"
            )
        hybrid_pair = is_hybrid(self.source.layout) or is_hybrid(self.decoder.layout)
        if hybrid_pair or isinstance(self.translator, HybridTranslator):
            _check_hybrid_translator(self.translator, self.source.layout, self.decoder.layout)
            return
        # The identity (no translator) is only valid between copies of one model; a translator must fit both.
        check_translator_fits(self.translator, self.source.layout, self.decoder.layout)

    @property
    def point(self) -> str:
        """Capture point of the translated cache (translated only)."""
        return self.translator.point if self.translator is not None else IDENTITY_POINT

    @property
    def max_positions(self) -> int:
        """The longest sequence (context + generated/scored tokens) every model involved can read."""
        limits = [self.decoder.layout.max_positions]
        if self.source is not None:
            limits.append(self.source.layout.max_positions)
        return min(limits)


def _check_hybrid_translator(translator, source, target) -> None:
    """A translated condition with a hybrid side needs a `HybridTranslator` built for these two layouts.

    Raises:
        ConfigError: no translator (there is no identity between hybrid caches: `kvlingo doctor MODEL` checks
            the round trip), a per-token translator, or one built for other layouts.
    """
    if not isinstance(translator, HybridTranslator):
        given = "no translator (identity)" if translator is None else f"a {type(translator).__name__}"
        raise ConfigError(f"a pair with a hybrid side is translated by a hybrid translator (a `kvlingo fit` artifact "
                          f"of the pair), got {given}; `kvlingo doctor MODEL` checks one model's own round trip")
    check_hybrid_translator_fits(translator, source, target)


def target_native(target: Side) -> Condition:
    """The target prefills the context itself."""
    return Condition(TARGET_NATIVE, decoder=target)


def source_native(source: Side) -> Condition:
    """The source answers from its own cache."""
    return Condition(SOURCE_NATIVE, decoder=source)


def empty_prefix(target: Side) -> Condition:
    """The floor: the target reads only the context's last token (nothing of the prefix before it)."""
    return Condition(EMPTY_PREFIX, decoder=target)


def visible_context(condition: Condition, context: torch.Tensor) -> torch.Tensor:
    """The ids the decoder reads itself: the whole context, except the last token only under `empty_prefix`."""
    return context[-1:] if condition.name == EMPTY_PREFIX else context


def translated(source: Side, target: Side, translator: Translator | None = None) -> Condition:
    """The target decodes from the translated source cache (translator None: identity, same model only)."""
    return Condition(TRANSLATED, decoder=target, source=source, translator=translator)


def _as_ids(ids: torch.Tensor | list[int], what: str) -> torch.Tensor:
    """Token ids as a 1-D int64 tensor [n]. Raises ConfigError for other shapes."""
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() != 1:
        raise ConfigError(f"{what} must be a 1-D list of token ids, got shape {list(t.shape)}")
    return t


def _translated_cache(condition: Condition, cached_ids: torch.Tensor):
    """The decoder's cache holding the translation of the source's cache of `cached_ids` [n-1]: per-token
    objects (GQA, MLA), or with a hybrid translator every attention layer's objects and every linear layer's
    conv window and recurrent state."""
    decoder, source = condition.decoder, condition.source
    if isinstance(condition.translator, HybridTranslator):
        held = capture_hybrid(source.model, source.layout, cached_ids, condition.point)
        tokens, states = condition.translator(held, decoder.model)
        return write_hybrid_cache(decoder.model, decoder.layout, tokens, states, point=condition.point)
    return write_cache(decoder.model, decoder.layout, _translated_objects(condition, cached_ids),
                       point=condition.point)


def _translated_objects(condition: Condition, cached_ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The decoder's cache objects for `cached_ids` [n-1], captured on the source and translated: object name →
    per layer [n-1, width] (GQA: keys, values; MLA: latent, rotary key)."""
    src = capture(condition.source.model, condition.source.layout, cached_ids, condition.point)
    if condition.translator is None:
        return src.objects
    return condition.translator.translate_objects(src.objects, src.token_ids)


def continuation_logits(
    condition: Condition, context_ids: torch.Tensor | list[int], continuation_ids: torch.Tensor | list[int]
) -> torch.Tensor:
    """The decoder's logits for each continuation token under `condition`: [m, vocab].

    Native: one forward over context + continuation[:-1], keeping the last m logits. Translated: the
    `student_logits` geometry (translated cache of context[:-1], then context[-1] + continuation[:-1]). A
    one-token context leaves nothing to translate (the cache would be empty), so it is read natively.
    Empty prefix: as native, over context[-1] + continuation[:-1] only.

    Args:
        context_ids: [n] token ids, n ≥ 1. continuation_ids: [m] token ids, m ≥ 1.
    Raises:
        ConfigError: empty context/continuation or non-1-D ids. PrefixTooLongError: longer than a model reads.
    """
    context = _as_ids(context_ids, "context_ids")
    continuation = _as_ids(continuation_ids, "continuation_ids")
    if context.numel() < 1 or continuation.numel() < 1:
        raise ConfigError(
            "scoring needs a non-empty context and continuation, "
            f"got {context.numel()} and {continuation.numel()} tokens"
        )
    m = continuation.numel()
    context = visible_context(condition, context)
    check_length(condition.decoder.layout, context.numel() + m - 1, "context + continuation")
    with torch.no_grad():
        if condition.name in UNTRANSLATED or context.numel() == 1:
            ids = torch.cat([context, continuation[:-1]]).view(1, -1).to(condition.decoder.model.device)
            return condition.decoder.model(input_ids=ids, use_cache=False, logits_to_keep=m).logits[0]
        return cache_logits(condition.decoder.model, _translated_cache(condition, context[:-1]), context, continuation)


def continuation_logprobs(
    condition: Condition, context_ids: torch.Tensor | list[int], continuation_ids: torch.Tensor | list[int]
) -> torch.Tensor:
    """log p(continuation_i | context, continuation_<i) under `condition`, in fp32: [m].

    Raises:
        ConfigError, PrefixTooLongError: as `continuation_logits`.
    """
    logits = continuation_logits(condition, context_ids, continuation_ids)  # [m, vocab]
    targets = _as_ids(continuation_ids, "continuation_ids").to(logits.device)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.view(-1, 1)).squeeze(-1).cpu()


def greedy_generate(
    condition: Condition,
    context_ids: torch.Tensor | list[int],
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] | tuple[int, ...] = (),
    *,
    should_stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy decoding after `context_ids` [n] under `condition`, by the platform's one decoding loop
    (`translators.generation.decode_from`, whose stop semantics apply: a stop id is returned as the last token).

    Native: prefill the context, then decode. Translated: translate the source cache of context[:-1], run
    one decoder step on context[-1], then decode on top of the injected cache. Empty prefix: read context[-1]
    alone, then decode.

    Args:
        max_new_tokens: the most tokens returned (≥ 0), a final stop id included.
        stop_ids: tokens that end generation (e.g. `infra.chat.stop_ids(tokenizer)`); the stop token is returned.
        should_stop: called with the tokens generated so far after each new token; True ends generation
            (used for stop strings, which need the decoded text).
    Returns:
        The generated token ids (at most max_new_tokens; ending with the stop id when one ended generation).
    Raises:
        ConfigError: empty context or negative max_new_tokens. PrefixTooLongError: context + generation longer
            than the models read.
    """
    context = _as_ids(context_ids, "context_ids")
    if context.numel() < 1:
        raise ConfigError("generation needs a non-empty context (at least one token)")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return []
    # The last generated token is never fed back, hence -1.
    check_length(condition.decoder.layout, context.numel() + max_new_tokens - 1, "context + generation")
    settings = GenerationSettings(max_new_tokens=max_new_tokens, stop_ids=tuple(sorted(stop_ids)))
    with torch.no_grad():
        cache, logits = _first_step(condition, context)  # logits: [vocab]
        decoded = decode_from(condition.decoder.model, cache, logits, settings, should_stop=should_stop)
    return decoded.token_ids


def _first_step(condition: Condition, context: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """The decoder's cache after reading the whole context and its next-token logits [vocab]."""
    model = condition.decoder.model
    context = visible_context(condition, context)
    if condition.name in UNTRANSLATED or context.numel() == 1:
        # A one-token context has no cache to translate: the decoder reads it natively.
        cache = DynamicCache(config=model.config)
        return cache, decode_step(model, cache, context, logits_to_keep=1)[-1]
    cache = _translated_cache(condition, context[:-1])
    return cache, decode_step(model, cache, context[-1:], logits_to_keep=1)[-1]
