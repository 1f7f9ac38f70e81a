import math

import pytest

from translators.errors import ConfigError
from translators.lr_selection import best_rate, initial_rates, next_rates, select_learning_rate


def test_initial_window_is_five_rates_half_a_decade_apart():
    rates = initial_rates(1e-3)
    assert len(rates) == 5 and rates[2] == 1e-3
    for a, b in zip(rates, rates[1:]):
        assert b / a == pytest.approx(math.sqrt(10), rel=1e-2)


def test_window_extends_while_best_is_on_an_edge():
    # Stubbed objective: a parabola in log-rate with its minimum at 3e-2, far right of the initial window.
    calls = []

    def objective(lr):
        calls.append(lr)
        return (math.log10(lr) - math.log10(3e-2)) ** 2

    selected, results = select_learning_rate(objective, 1e-4)
    assert selected == pytest.approx(3.16e-2, rel=1e-2)
    tried = sorted(results)
    assert tried[0] < selected < tried[-1]  # the selected rate is interior, as App. E requires
    assert len(calls) == len(set(calls))  # no rate trained twice


def test_interior_best_needs_no_extension_and_diverged_runs_never_win():
    assert next_rates({1e-4: 1.0, 3.16e-4: 0.5, 1e-3: 0.7}) == []
    assert next_rates({1e-4: 0.4, 3.16e-4: 0.5}) == [pytest.approx(3.16e-5, rel=1e-2)]
    assert best_rate({1e-3: float("nan"), 1e-4: 2.0}) == 1e-4
    with pytest.raises(ConfigError, match="diverged"):
        best_rate({1e-3: float("inf")})


def test_bad_centre_and_edge_after_max_extensions():
    with pytest.raises(ConfigError, match="> 0"):
        initial_rates(0.0)
    with pytest.raises(ConfigError, match="still on the edge"):
        select_learning_rate(lambda lr: -lr, 1e-3, max_extensions=1)
