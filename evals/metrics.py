"""Per-item scores and their aggregation: token F1, exact match, gold-in-answer, standard errors, paired
bootstrap confidence intervals, and the JSON score row.

Error bars follow KV-Lingo App. E.1: the standard error of a score over its evaluation items (sample standard
deviation / sqrt(n)). Paired differences follow the second paper (§4): a percentile bootstrap over items
(10,000 resamples, 95% CI) of the mean per-item difference between two conditions on the same items.

A condition's per-item scores are keyed by item id (`ItemScores`, item id -> score): a condition may fail an
item (an unparseable verdict, a missing metric), and pairing two conditions by position after such drops would
compare different items. `paired_by_id` keeps the ids scored in both and aligns them.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from translators.errors import ConfigError

ItemScores = Mapping[str, float]
"""One condition's per-item scores, item id -> score; an item the condition failed is absent."""

# ---------------------------------------------------------------------------------------------------------------
# Text answers (SQuAD-style normalisation)
# ---------------------------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse spaces."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(gold: str | Sequence[str]) -> list[str]:
    """One gold string or several as a list.

    Raises:
        ConfigError: an empty list of golds (the maximum over no references is undefined).
    """
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ConfigError("no gold answers given: pass at least one reference string")
    return golds


def _f1_single(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        # Both empty (e.g. the gold is only an article) counts as a match, one empty as a miss.
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Bag-of-tokens F1 between the normalised prediction and gold, maximised over several golds. In [0, 1].

    Raises:
        ConfigError: `gold` is an empty list.
    """
    return max(_f1_single(prediction, g) for g in _golds(gold))


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold, else 0.0.

    Raises:
        ConfigError: `gold` is an empty list.
    """
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(gold)))


def gold_in_answer(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if a normalised gold occurs in the normalised prediction as a whole-token span, else 0.0.

    Insensitive to answer length (a verbose correct answer scores 1). Matching whole tokens (padding both sides
    with spaces) keeps the gold "30" from matching inside "1300". An empty normalised gold only matches an
    empty prediction.

    Raises:
        ConfigError: `gold` is an empty list.
    """
    pred = normalize_answer(prediction)
    for g in _golds(gold):
        norm = normalize_answer(g)
        if (f" {norm} " in f" {pred} ") if norm else not pred:
            return 1.0
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# Aggregation and error bars
# ---------------------------------------------------------------------------------------------------------------


def _as_scores(values: Sequence[float] | np.ndarray, name: str = "values") -> np.ndarray:
    """Per-item scores as a finite float64 vector: [n].

    Raises:
        ConfigError: empty, not one-dimensional, or containing NaN/Inf.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be one score per item (1-D), got shape {arr.shape}")
    if arr.size == 0:
        raise ConfigError(f"{name} is empty: a score needs at least one evaluated item")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{name} contains NaN or Inf at items {np.flatnonzero(~np.isfinite(arr))[:10].tolist()}")
    return arr


def mean_se(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean of per-item scores and its standard error, sample std (ddof=1) / sqrt(n) (App. E.1).

    With a single item the standard error is reported as 0.0 (it is undefined; there is no spread to measure).

    Raises:
        ConfigError: no items, or NaN/Inf among them.
    """
    arr = _as_scores(values)
    if arr.size == 1:
        return float(arr[0]), 0.0
    return float(arr.mean()), float(arr.std(ddof=1) / math.sqrt(arr.size))


def paired_bootstrap_ci(
    translated: Sequence[float] | np.ndarray,
    native: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of translated − native over the same items, with a percentile bootstrap CI: (delta, low, high).

    Items are resampled with replacement (scipy.stats.bootstrap on the per-item differences, which is the
    paired bootstrap of the mean difference). translated[i] and native[i] must score the same item i.

    Raises:
        ConfigError: lengths differ, fewer than two items, NaN/Inf scores, confidence outside (0, 1), or
            n_resamples < 1.
    """
    t = _as_scores(translated, "translated")
    nat = _as_scores(native, "native")
    if t.size != nat.size:
        raise ConfigError(f"paired scores must cover the same items: {t.size} translated vs {nat.size} native")
    if t.size < 2:
        raise ConfigError(f"a bootstrap CI needs at least 2 paired items, got {t.size}")
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ConfigError(f"n_resamples must be >= 1, got {n_resamples}")
    diff = t - nat  # [n]
    if np.ptp(diff) == 0.0:
        # Every resample has the same mean; scipy reports such degenerate data as NaN, the exact CI is [d, d].
        return float(diff[0]), float(diff[0]), float(diff[0])
    res = stats.bootstrap((diff,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                          method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return float(diff.mean()), float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_by_id(translated: ItemScores, native: ItemScores) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The items scored in both conditions, aligned by id: (ids in sorted order, translated [n], native [n]).

    An item either condition lacks is left out of both vectors, so position i of the two always scores the same
    item (the input paired_bootstrap_ci expects).

    Raises:
        ConfigError: either argument is not a mapping of item id -> score.
    """
    _check_item_scores(translated, "translated")
    _check_item_scores(native, "native")
    ids = sorted(set(translated) & set(native))
    return (ids, np.array([translated[i] for i in ids], dtype=np.float64),
            np.array([native[i] for i in ids], dtype=np.float64))


def _check_item_scores(scores: Any, name: str) -> None:
    """Raises ConfigError when `scores` is not a mapping item id -> score (e.g. a positional array)."""
    if not isinstance(scores, Mapping):
        raise ConfigError(f"{name} must map item id -> score so conditions pair up by item, got "
                          f"{type(scores).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Result rows
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ScoreRow:
    """One benchmark score for one condition, the unit of the eval CLI's JSON output.

    Public keys of to_dict(): benchmark, condition, score, se, n, ci_low, ci_high, extra.
    score ± se is the condition's own mean over items. ci_low/ci_high bound the paired difference
    condition − target native over the item ids both scored (set for translated conditions, null otherwise);
    score_row puts the point difference in extra["delta"] and the number of shared items in extra["n_paired"].
    extra holds free-form details.
    """

    benchmark: str
    condition: str
    score: float
    se: float
    n: int
    ci_low: float | None = None
    ci_high: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.ci_low is None) != (self.ci_high is None):
            raise ConfigError(f"{self.benchmark}/{self.condition}: give both ci_low and ci_high, or neither")
        if self.n < 0 or self.se < 0:
            raise ConfigError(f"{self.benchmark}/{self.condition}: n and se must be >= 0, got n={self.n}, "
                              f"se={self.se}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (numpy scalars converted to Python numbers)."""
        return {
            "benchmark": self.benchmark,
            "condition": self.condition,
            "score": float(self.score),
            "se": float(self.se),
            "n": int(self.n),
            "ci_low": None if self.ci_low is None else float(self.ci_low),
            "ci_high": None if self.ci_high is None else float(self.ci_high),
            "extra": _plain(self.extra),
        }


def _plain(value: Any) -> Any:
    """Recursively turn numpy scalars/arrays into Python numbers/lists so json.dumps accepts them."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def score_row(
    benchmark: str,
    condition: str,
    per_item: ItemScores,
    native: ItemScores | None = None,
    **bootstrap_kwargs: Any,
) -> ScoreRow:
    """A ScoreRow from one condition's per-item scores (item id -> score); with `native` (the reference
    condition's per-item scores), also the paired difference over the items scored in both, aligned by id.

    score, se and n describe the condition's own items; extra["delta"] (the point difference), ci_low/ci_high
    (its paired bootstrap CI) and extra["n_paired"] cover the ids present in both conditions only.

    bootstrap_kwargs: confidence, n_resamples, seed of paired_bootstrap_ci.

    Raises:
        ConfigError: per_item or native not a mapping; as mean_se; with `native`, as paired_bootstrap_ci on
            the shared items (fewer than two of them, among others).
    """
    _check_item_scores(per_item, "per_item")
    mean, se = mean_se(list(per_item.values()))
    row = ScoreRow(benchmark, condition, mean, se, len(per_item))
    if native is not None:
        ids, translated, reference = paired_by_id(per_item, native)
        delta, low, high = paired_bootstrap_ci(translated, reference, **bootstrap_kwargs)
        row.ci_low, row.ci_high = low, high
        row.extra["delta"] = delta
        row.extra["n_paired"] = len(ids)
    return row
