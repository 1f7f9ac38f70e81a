"""The paired conditions for a pair whose models tokenize differently (KV-Lingo App. K).

Items are conversations (messages), not token ids: each model renders them in its own format
(`infra.cross_samples`), so the same item reaches every condition:

- `target_native`: the target prefills its own rendering (the upper anchor).
- `source_native`: the source answers from its own rendering, in its own tokens (the model switched away from).
- `translated`: the target reads the source's content translated between its own prefilled boilerplate
  (`translators.cross.mixed_cache`), exactly the geometry stage 2 trains on.
- `empty_prefix`: the target reads only the last token of its prefix, no cache (the floor).

Benchmarks whose runners read items through `generate_messages` / `answer_logprob` (spec `cross_tokenizer`)
run on such pairs; the others need token ids shared by both models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from evals.conditions import CONDITIONS, EMPTY_PREFIX, SOURCE_NATIVE, TARGET_NATIVE, TRANSLATED
from translators.errors import ConfigError
from translators.stage1 import Side
from translators.switch import check_translator_fits
from translators.translator import Translator


@dataclass(frozen=True)
class CrossCondition:
    """One way of answering a conversation on a cross-tokenizer pair.

    Args:
        name: one of `evals.conditions.CONDITIONS`.
        source, target: the loaded models (`infra.zoo.LoadedModel`: .model, .tokenizer, .layout).
        translator: the source → target translator (`translated` only).
    Raises:
        ConfigError: unknown name, or `translated` without a translator.
        PairMismatchError: a translator whose maps do not fit the two layouts.
    """

    name: str
    source: Any
    target: Any
    translator: Translator | None = None

    def __post_init__(self) -> None:
        if self.name not in CONDITIONS:
            raise ConfigError(f"unknown condition {self.name!r}; choose from {', '.join(CONDITIONS)}")
        if self.name == TRANSLATED and self.translator is None:
            raise ConfigError("a translated condition on a cross-tokenizer pair needs a fitted translator (the "
                              "identity cannot map one vocabulary's cache onto another's)")
        if self.translator is not None:
            check_translator_fits(self.translator, self.source.layout, self.target.layout)

    @property
    def decoder(self) -> Any:
        """The model whose tokens the answer is in."""
        return self.source if self.name == SOURCE_NATIVE else self.target

    @property
    def max_prefix_tokens(self) -> int:
        return min(self.source.layout.max_positions, self.target.layout.max_positions)


def _sides(condition: CrossCondition) -> tuple[Side, Side]:
    return (Side(condition.source.model, condition.source.layout), Side(condition.target.model, condition.target.layout))


def _prompt(condition: CrossCondition, messages: list[dict], answer_ids=()):
    from infra.cross_samples import cross_prompt

    return cross_prompt(condition.source.tokenizer, condition.target.tokenizer, messages,
                        max_prefix_tokens=condition.max_prefix_tokens, continuation_ids=answer_ids)


def generate_messages(condition: CrossCondition, messages: list[dict], max_new_tokens: int) -> str | None:
    """The decoder's greedy answer text to `messages` (up to its stop ids), or None when the conversation does not
    fit both models or holds no content that aligns."""
    from infra.chat import stop_ids
    from infra.cross_samples import render_prefix
    from translators.cross import generate_cross
    from translators.generation import GenerationSettings

    decoder = condition.decoder
    stops = stop_ids(decoder.tokenizer)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, stop_ids=stops)
    if condition.name == SOURCE_NATIVE:
        from evals.conditions import greedy_generate, source_native

        _text, ids, _offsets = render_prefix(decoder.tokenizer, messages)
        if len(ids) + max_new_tokens > decoder.layout.max_positions:
            return None
        out = greedy_generate(source_native(_sides(condition)[0]), torch.tensor(ids), max_new_tokens, stops)
    else:
        sample = _prompt(condition, messages)
        if sample is None or sample.target_ids.numel() + max_new_tokens > condition.max_prefix_tokens:
            return None
        source, target = _sides(condition)
        out = generate_cross(condition.name, source, target, sample, condition.translator, settings).token_ids
    answer = out[:-1] if out and out[-1] in stops else out
    return decoder.tokenizer.decode(answer, skip_special_tokens=True)


def answer_logprob(condition: CrossCondition, messages: list[dict], answer: str) -> float | None:
    """log p(answer | messages) in nats under a target condition (the answer tokenized by the target as its render
    continues, `infra.chat.answer_text`: a leading space where the target's format puts one), or None when nothing
    aligns or it does not fit.

    Raises:
        ConfigError: source_native (its log-probabilities are over another vocabulary: not comparable).
    """
    from infra.chat import answer_text
    from translators.cross import continuation_logprob

    if condition.name == SOURCE_NATIVE:
        raise ConfigError("source_native log-probabilities are over the source's vocabulary; compare target conditions")
    tokenizer = condition.target.tokenizer
    answer_ids = tokenizer(answer_text(tokenizer, messages, answer), add_special_tokens=False)["input_ids"]
    sample = _prompt(condition, messages, answer_ids)
    if sample is None or sample.target_ids.numel() + len(answer_ids) > condition.max_prefix_tokens:
        return None
    source, target = _sides(condition)
    return continuation_logprob(condition.name, source, target, sample, condition.translator)


def cross_conditions(source: Any, target: Any, translators: dict[str, Translator]) -> dict[str, CrossCondition]:
    """The anchors plus one translated condition per named translator (e.g. closed_form, distilled)."""
    conditions = {name: CrossCondition(name, source, target) for name in (TARGET_NATIVE, SOURCE_NATIVE, EMPTY_PREFIX)}
    for label, translator in translators.items():
        conditions[label] = CrossCondition(TRANSLATED, source, target, translator)
    return conditions
