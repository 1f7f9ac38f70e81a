import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from evals.metrics import (ScoreRow, exact_match, gold_in_answer, mean_se, normalize_answer, paired_bootstrap_ci,
                           paired_by_id, score_row, token_f1)
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
