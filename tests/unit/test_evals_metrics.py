import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from evals.metrics import (ScoreRow, accuracy, binomial_se, combine_disjoint, correct, exact_match, gold_in_answer,
                           mean_se, normalize_answer, paired_bootstrap_ci, paired_by_id, per_item_means, perplexity,
                           score_row, token_f1, token_nll)
from translators.errors import ConfigError

# --- text answers ---------------------------------------------------------------------------------------------


def test_normalize_answer_lowercases_and_drops_punctuation_and_articles():
    assert normalize_answer("  The Eiffel-Tower, in   Paris!  ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_token_f1_hand_computed():
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: overlap 3, P = 3/4, R = 1, F1 = 6/7.
    assert token_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    # Multiset overlap: [x, x, y] vs [x, y, y] share min(2,1) + min(1,2) = 2 tokens: P = R = 2/3.
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert token_f1("Denver Broncos", "Carolina Panthers") == 0.0
    assert token_f1("Denver", ["Carolina Panthers", "the Denver Broncos"]) == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_token_f1_empty_after_normalisation():
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("", "Paris") == 0.0


def test_exact_match_and_gold_in_answer():
    assert exact_match("The Eiffel Tower!", "eiffel tower") == 1.0
    assert exact_match("Eiffel Tower in Paris", "eiffel tower") == 0.0
    assert exact_match("paris", ["London", "Paris"]) == 1.0
    assert gold_in_answer("The answer is the Denver Broncos.", "Denver Broncos") == 1.0
    assert gold_in_answer("It lasted 1300 years", "30") == 0.0  # whole tokens only
    assert gold_in_answer("It lasted 1300 years", ["30", "1300"]) == 1.0
    assert gold_in_answer("Carolina", "Denver") == 0.0


def test_empty_gold_list_is_a_config_error():
    for fn in (token_f1, exact_match, gold_in_answer):
        with pytest.raises(ConfigError, match="no gold answers"):
            fn("x", [])


def test_accuracy_with_parse_failures():
    flags = correct(["A", " b", None, "D"], ["A", "b", "C", "C"])
    assert flags.tolist() == [1.0, 1.0, 0.0, 0.0]
    acc, se = accuracy(["A", " b", None, "D"], ["A", "b", "C", "C"])
    assert acc == 0.5 and se == pytest.approx(np.std(flags, ddof=1) / 2)
    with pytest.raises(ConfigError, match="pair up"):
        correct(["A"], ["A", "B"])


# --- standard errors ------------------------------------------------------------------------------------------


def test_mean_se_matches_numpy():
    values = np.random.default_rng(1).normal(3.0, 2.0, 57)
    mean, se = mean_se(values.tolist())
    assert mean == pytest.approx(values.mean())
    assert se == pytest.approx(values.std(ddof=1) / math.sqrt(57))
    assert se == pytest.approx(stats.sem(values))


def test_mean_se_single_item_and_bad_input():
    assert mean_se([0.7]) == (0.7, 0.0)
    with pytest.raises(ConfigError, match="empty"):
        mean_se([])
    with pytest.raises(ConfigError, match="NaN"):
        mean_se([1.0, float("nan")])
    with pytest.raises(ConfigError, match="1-D"):
        mean_se([[1.0, 2.0]])


def test_binomial_se():
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    with pytest.raises(ConfigError):
        binomial_se(1.5, 10)


def test_combine_disjoint_formula_by_hand():
    groups = [(0.5, 0.1, 10), (0.8, 0.2, 30)]
    mean, se, n = combine_disjoint(groups)  # equal weights (macro), App. E.1
    assert (mean, n) == (pytest.approx(0.65), 40)
    assert se == pytest.approx(math.sqrt(0.25 * 0.01 + 0.25 * 0.04))
    mean, se, n = combine_disjoint(groups, weights="items")
    assert mean == pytest.approx((0.5 * 10 + 0.8 * 30) / 40)
    assert se == pytest.approx(math.sqrt(10**2 * 0.01 + 30**2 * 0.04) / 40)
    mean, se, _ = combine_disjoint(groups, weights=[0.2, 0.8])
    assert mean == pytest.approx(0.2 * 0.5 + 0.8 * 0.8)
    assert se == pytest.approx(math.sqrt(0.04 * 0.01 + 0.64 * 0.04))


def test_combine_disjoint_items_weighting_matches_pooling_raw_items():
    # Each group is a permutation of the same values (equal means and variances), so the stratified and pooled
    # estimates differ only by the degrees of freedom: se_combined^2 / se_pooled^2 = (N - 1) / (N - k).
    base = np.random.default_rng(2).normal(0.0, 1.0, 40)
    groups = [np.random.default_rng(s).permutation(base) for s in range(5)]
    parts = [(*mean_se(g), g.size) for g in groups]
    pooled_mean, pooled_se = mean_se(np.concatenate(groups))
    mean, se, n = combine_disjoint(parts, weights="items")
    assert n == 200 and mean == pytest.approx(pooled_mean)
    assert se == pytest.approx(pooled_se * math.sqrt((200 - 1) / (200 - 5)))
    # Equal group sizes: equal and item weights agree.
    assert combine_disjoint(parts) == pytest.approx((mean, se, n))


def test_combine_disjoint_errors():
    with pytest.raises(ConfigError):
        combine_disjoint([])
    with pytest.raises(ConfigError, match="n >= 1"):
        combine_disjoint([(0.5, 0.1, 0)])
    with pytest.raises(ConfigError, match="unknown weighting"):
        combine_disjoint([(0.5, 0.1, 3)], weights="macro")
    with pytest.raises(ConfigError, match="summing to 1"):
        combine_disjoint([(0.5, 0.1, 3), (0.5, 0.1, 3)], weights=[0.5, 0.6])


# --- paired bootstrap -----------------------------------------------------------------------------------------


def _paired_sample(n=300, delta=0.3, seed=3):
    rng = np.random.default_rng(seed)
    native = rng.normal(0.0, 1.0, n)  # item difficulty dominates the spread
    return native + delta + rng.normal(0.0, 0.2, n), native


def test_paired_bootstrap_ci_contains_true_delta_and_matches_normal_theory():
    translated, native = _paired_sample()
    delta, low, high = paired_bootstrap_ci(translated, native, n_resamples=2000)
    assert delta == pytest.approx(np.mean(translated - native))
    assert low < 0.3 < high and low < delta < high
    # Independent reference: the normal-theory 95% width 2 * 1.96 * sd(diff) / sqrt(n).
    expected = 2 * 1.96 * np.std(translated - native, ddof=1) / math.sqrt(translated.size)
    assert high - low == pytest.approx(expected, rel=0.15)


def test_paired_ci_is_narrower_than_unpaired():
    translated, native = _paired_sample()
    _, low, high = paired_bootstrap_ci(translated, native, n_resamples=2000)
    unpaired = stats.bootstrap((translated, native), lambda a, b, axis: a.mean(axis) - b.mean(axis),
                               n_resamples=2000, method="percentile", vectorized=True,
                               rng=np.random.default_rng(0)).confidence_interval
    assert (high - low) < 0.5 * (unpaired.high - unpaired.low)


def test_paired_bootstrap_is_deterministic_and_handles_ties():
    translated, native = _paired_sample(n=50)
    assert paired_bootstrap_ci(translated, native, n_resamples=500, seed=7) == \
        paired_bootstrap_ci(translated, native, n_resamples=500, seed=7)
    same = [1.0, 0.0, 1.0, 1.0]
    assert paired_bootstrap_ci(same, same, n_resamples=200) == (0.0, 0.0, 0.0)


def test_paired_bootstrap_errors():
    with pytest.raises(ConfigError, match="same items"):
        paired_bootstrap_ci([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ConfigError, match="at least 2"):
        paired_bootstrap_ci([1.0], [0.0])
    with pytest.raises(ConfigError, match="confidence"):
        paired_bootstrap_ci([1.0, 2.0], [0.0, 1.0], confidence=95)


# --- per-token quantities -------------------------------------------------------------------------------------


def test_perplexity_and_token_nll():
    assert perplexity([math.log(2.0)] * 5) == pytest.approx(2.0)
    assert perplexity(np.array([0.0, 2 * math.log(3.0)])) == pytest.approx(3.0)
    # Uniform logits over 11 tokens: every NLL is log 11, so perplexity is 11.
    nll = token_nll(torch.zeros(4, 11), torch.tensor([0, 3, 5, 10]))
    assert nll == pytest.approx([math.log(11.0)] * 4)
    assert perplexity(nll) == pytest.approx(11.0)
    logits = torch.randn(6, 13, generator=torch.Generator().manual_seed(0))
    targets = torch.arange(6)
    ref = torch.nn.functional.cross_entropy(logits, targets, reduction="none").numpy()
    assert token_nll(logits, targets) == pytest.approx(ref, rel=1e-6)
    with pytest.raises(ConfigError, match="token_nll"):
        token_nll(torch.zeros(3, 5), torch.zeros(4))
    with pytest.raises(ConfigError):
        perplexity([])


def test_per_item_means_weighs_each_item_once():
    assert per_item_means([[1.0, 3.0], [4.0], np.array([0.0, 0.0, 3.0])]).tolist() == [2.0, 4.0, 1.0]
    with pytest.raises(ConfigError, match="item 1"):
        per_item_means([[1.0], []])


# --- result rows ----------------------------------------------------------------------------------------------


def test_score_row_to_dict_is_json_and_has_public_keys():
    row = ScoreRow("ruler", "target_native", np.float64(0.9), np.float32(0.05), np.int64(20),
                   extra={"per_length": {"4096": np.float64(1.0)}, "lengths": np.array([4096])})
    d = json.loads(json.dumps(row.to_dict()))
    assert {"benchmark", "condition", "score", "se", "n", "ci_low", "ci_high"} <= set(d)
    assert d["n"] == 20 and d["ci_low"] is None and d["extra"]["per_length"]["4096"] == 1.0
    with pytest.raises(ConfigError, match="both ci_low and ci_high"):
        ScoreRow("arc", "distilled", 0.5, 0.1, 10, ci_low=0.1)


def _by_id(values):
    return {f"{i:02d}": float(v) for i, v in enumerate(values)}


def test_score_row_with_native_carries_paired_ci():
    translated, native = _paired_sample(n=40)
    row = score_row("coqa", "distilled", _by_id(translated), _by_id(native), n_resamples=500)
    delta, low, high = paired_bootstrap_ci(translated, native, n_resamples=500)
    assert row.score == pytest.approx(translated.mean()) and row.n == 40 and row.extra["n_paired"] == 40
    assert (row.ci_low, row.ci_high, row.extra["delta"]) == (low, high, delta)
    assert score_row("coqa", "target_native", _by_id(native)).ci_low is None
    with pytest.raises(ConfigError, match="item id"):
        score_row("coqa", "distilled", translated, _by_id(native))


def test_score_row_pairs_conditions_by_item_id_not_by_position():
    # The translated condition failed item "5", the native one item "2": the paired difference covers
    # items 0, 1, 3, 4, 6, 7 only, each translated score against the native score of the same item.
    translated = {"0": 0.9, "1": 0.4, "2": 0.7, "3": 0.5, "4": 0.8, "6": 0.3, "7": 0.6}
    native = {"0": 1.0, "1": 0.6, "3": 0.5, "4": 1.0, "5": 0.2, "6": 0.6, "7": 0.6}
    row = score_row("arc", "distilled", translated, native, n_resamples=2000, seed=3)
    # Hand-aligned: differences -0.1, -0.2, 0.0, -0.2, -0.3, 0.0 → mean -0.8 / 6.
    ref_t, ref_n = [0.9, 0.4, 0.5, 0.8, 0.3, 0.6], [1.0, 0.6, 0.5, 1.0, 0.6, 0.6]
    delta, low, high = paired_bootstrap_ci(ref_t, ref_n, n_resamples=2000, seed=3)
    assert row.extra["delta"] == pytest.approx(-0.8 / 6) and delta == pytest.approx(-0.8 / 6)
    assert (row.extra["delta"], row.ci_low, row.ci_high) == (delta, low, high)
    assert row.extra["n_paired"] == 6 and row.n == 7 and row.score == pytest.approx(4.2 / 7)
    assert paired_by_id(translated, native)[0] == ["0", "1", "3", "4", "6", "7"]


def test_evals_import_no_orchestration_packages():
    code = ("import sys, evals.metrics, evals.ruler, evals.qa, evals.judge; "
            "print(sorted(m for m in ('prefect', 'ray', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
