"""Per-item scores and their aggregation: token F1, exact match, gold-in-answer, accuracy, standard errors,
pooling over disjoint subsets, paired bootstrap confidence intervals, perplexity, and the JSON score row.

Error bars follow KV-Lingo App. E.1: the standard error of a score over its evaluation items (sample standard
deviation / sqrt(n)); a score averaged over disjoint item sets combines its parts' standard errors as
sqrt(sum_j w_j^2 se_j^2). Paired differences follow the second paper (§4): a percentile bootstrap over items
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


def correct(predictions: Sequence[Any], golds: Sequence[Any]) -> np.ndarray:
    """Per-item 0/1 correctness of predicted labels against gold labels (e.g. multiple-choice letters): [n].

    Labels are compared after str() and strip(), case-sensitively (a parse failure should be None, which never
    matches).

    Raises:
        ConfigError: the two sequences differ in length.
    """
    if len(predictions) != len(golds):
        raise ConfigError(f"{len(predictions)} predictions for {len(golds)} gold labels: they must pair up")
    return np.array([float(p is not None and str(p).strip() == str(g).strip())
                     for p, g in zip(predictions, golds)])


def accuracy(predictions: Sequence[Any], golds: Sequence[Any]) -> tuple[float, float]:
    """(accuracy, standard error) of predicted labels against gold labels.

    Raises:
        ConfigError: lengths differ or there are no items.
    """
    return mean_se(correct(predictions, golds))


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


def binomial_se(p: float, n: int) -> float:
    """sqrt(p (1 - p) / n): the error bar of an accuracy known only as an aggregate (App. E.1).

    Raises:
        ConfigError: p outside [0, 1] or n < 1.
    """
    if not 0.0 <= p <= 1.0 or n < 1:
        raise ConfigError(f"binomial_se needs 0 <= p <= 1 and n >= 1, got p={p}, n={n}")
    return math.sqrt(p * (1.0 - p) / n)


def combine_disjoint(
    groups: Sequence[tuple[float, float, int]],
    weights: str | Sequence[float] = "equal",
) -> tuple[float, float, int]:
    """Pool (mean, se, n) scores of disjoint item sets into one (mean, se, n).

    KV-Lingo App. E.1: "A score averaged over disjoint item sets (MMLU-Pro over its 14 categories, RULER over
    its rungs, a mean over benchmarks) combines the standard errors of its parts as sqrt(sum_j w_j^2 se_j^2)."
    The mean is sum_j w_j mean_j; n is the total item count.

    weights: "equal" (w_j = 1/k, a macro average, the paper's examples), "items" (w_j = n_j / N, the
        item-weighted mean, whose se is sqrt(sum_j n_j^2 se_j^2) / N), or explicit weights summing to 1.

    Raises:
        ConfigError: no groups, a group that is not a (mean, se, n) triple, a group with n < 1 or a
            negative/non-finite se, an unknown weighting, or explicit weights of the wrong length or not summing
            to 1.
    """
    if not groups or any(len(g) != 3 for g in groups):
        raise ConfigError(f"combine_disjoint needs one or more (mean, se, n) triples, got {list(groups)}")
    means, ses, ns = (np.array(col, dtype=np.float64) for col in zip(*groups))
    if np.any(ns < 1) or np.any(ses < 0) or not np.all(np.isfinite(np.concatenate([means, ses]))):
        raise ConfigError(f"every group needs a finite mean, a finite se >= 0 and n >= 1, got {list(groups)}")
    w = _group_weights(weights, ns)
    return float(w @ means), float(math.sqrt(float((w**2) @ (ses**2)))), int(ns.sum())


def _group_weights(weights: str | Sequence[float], ns: np.ndarray) -> np.ndarray:
    """Weights w_j for combine_disjoint: [k].

    Raises:
        ConfigError: unknown name, wrong length, or weights not summing to 1.
    """
    if isinstance(weights, str):
        if weights == "equal":
            return np.full(ns.size, 1.0 / ns.size)
        if weights == "items":
            return ns / ns.sum()
        raise ConfigError(f"unknown weighting {weights!r}: use 'equal', 'items' or a list of weights")
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != ns.size or not math.isclose(float(w.sum()), 1.0, abs_tol=1e-9):
        raise ConfigError(f"explicit weights must be {ns.size} numbers summing to 1, got {list(weights)}")
    return w


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
# Per-token quantities: NLL, perplexity, KL
# ---------------------------------------------------------------------------------------------------------------


def perplexity(nll_per_token: Sequence[float] | np.ndarray) -> float:
    """exp(mean NLL in nats) over all tokens given: [n_tokens] -> scalar.

    Concatenate the tokens of several sequences for a token-weighted corpus perplexity.

    Raises:
        ConfigError: no tokens, or NaN/Inf.
    """
    return float(math.exp(_as_scores(nll_per_token, "nll_per_token").mean()))


def per_item_means(per_token: Sequence[Sequence[float] | np.ndarray]) -> np.ndarray:
    """Mean of each item's per-token values (e.g. KL or NLL per continuation token): list of [m_i] -> [n_items].

    This is the per-item score whose mean_se gives validation KL ± se, each conversation weighing one.

    Raises:
        ConfigError: no items, or an item with no tokens or NaN/Inf.
    """
    if len(per_token) == 0:
        raise ConfigError("no items: per_item_means needs at least one per-token array")
    return np.array([_as_scores(v, f"item {i}").mean() for i, v in enumerate(per_token)])


def token_nll(logits: Any, targets: Any) -> np.ndarray:
    """Negative log-likelihood (nats) of each target token under logits, computed in fp32: [m, vocab], [m] -> [m].

    Accepts torch tensors or numpy arrays.

    Raises:
        ConfigError: shapes do not pair up.
    """
    import torch  # only this helper needs torch; keep the text metrics importable without it loaded

    logits = torch.as_tensor(logits).float()
    targets = torch.as_tensor(targets).long().reshape(-1)
    if logits.ndim != 2 or logits.shape[0] != targets.numel():
        raise ConfigError(f"token_nll needs logits [m, vocab] and targets [m], got {tuple(logits.shape)} and "
                          f"{tuple(targets.shape)}")
    logp = torch.log_softmax(logits, dim=-1)  # [m, vocab]
    return (-logp.gather(1, targets[:, None])[:, 0]).detach().cpu().numpy().astype(np.float64)


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
