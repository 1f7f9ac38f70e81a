"""Switch quality on held-out prefixes: the target's greedy continuation from the translated cache against
its continuation from its own prefill (the native continuation).

Per item: whether the first generated token agrees, and the token F1 (bag-of-tokens overlap, SQuAD style, over
token ids) of the switched continuation against the native one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evals.metrics import mean_se
from translators.errors import ConfigError
from translators.generation import GenerationSettings
from translators.stage1 import Side
from translators.switch import reprefill_generate, switch_generate
from translators.translator import Translator


@dataclass
class SwitchQualityRecord:
    """One held-out prefix."""

    item: int
    n_prefix: int
    first_token_match: bool
    token_f1: float
    switched_ids: list[int]
    native_ids: list[int]
    switched_text: str | None = None
    native_text: str | None = None


def token_id_f1(prediction: Sequence[int], reference: Sequence[int]) -> float:
    """F1 of the multiset overlap of two token-id sequences (not `evals.metrics.token_f1`, which compares
    normalised answer text) (1.0 when both are empty, 0.0 when one is)."""
    if not prediction and not reference:
        return 1.0
    common = sum((Counter(prediction) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def switch_quality(
    source: Side,
    target: Side,
    prefixes: Sequence[torch.Tensor],
    translator: Translator | None,
    settings: GenerationSettings | None = None,
    *,
    point: str | None = None,
    context_len: int | None = None,
    tokenizer: Any = None,
) -> list[SwitchQualityRecord]:
    """Greedy continuations after a switch vs after the target's own prefill, one record per prefix.

    Args:
        prefixes: [n_i] token ids each (n_i ≥ 2 so that something is translated).
        settings: greedy only (temperature 0); default 32 new tokens, no stop ids.
        context_len: k for every item (App. T); default n_i - 1.
    Raises:
        ConfigError: no prefixes, sampling settings, or what `switch_generate` raises.
    """
    settings = settings or GenerationSettings(max_new_tokens=32)
    if settings.temperature != 0.0:
        raise ConfigError("switch quality compares greedy continuations: use temperature 0")
    if not prefixes:
        raise ConfigError("no held-out prefixes to evaluate")
    records = []
    for i, prefix in enumerate(prefixes):
        switched = switch_generate(
            source, target, prefix, translator, settings, point=point, context_len=context_len, tokenizer=tokenizer
        )
        native = reprefill_generate(target, prefix, settings, tokenizer=tokenizer)
        records.append(
            SwitchQualityRecord(
                item=i,
                n_prefix=int(torch.as_tensor(prefix).numel()),
                first_token_match=switched.token_ids[0] == native.token_ids[0],
                token_f1=token_id_f1(switched.token_ids, native.token_ids),
                switched_ids=switched.token_ids,
                native_ids=native.token_ids,
                switched_text=switched.text,
                native_text=native.text,
            )
        )
    return records


def summarize(records: Sequence[SwitchQualityRecord]) -> dict[str, float]:
    """Means over items with their standard errors: first-token agreement and token F1.

    Raises:
        ConfigError: no records.
    """
    if not records:
        raise ConfigError("no switch-quality records to summarize")
    out: dict[str, float] = {"n": float(len(records))}
    for name, values in (
        ("first_token_agreement", [float(r.first_token_match) for r in records]),
        ("token_f1", [r.token_f1 for r in records]),
    ):
        out[name], out[f"{name}_se"] = mean_se(values)
    return out
