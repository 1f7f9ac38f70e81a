"""Learning-rate selection (App. E): five rates half a decade apart around a centre; extend the window while
the best rate sits on its edge; select the rate with the lowest final validation KL. Pure logic — the sweep
flow runs the trainings."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from translators.errors import ConfigError

HALF_DECADE = math.sqrt(10.0)


def initial_rates(centre: float, n: int = 5) -> list[float]:
    """n rates spaced half a decade apart, centred on `centre` (n odd)."""
    if not centre > 0:
        raise ConfigError(f"the centre learning rate must be > 0, got {centre}")
    if n < 3 or n % 2 == 0:
        raise ConfigError(f"the rate window needs an odd number ≥ 3 of rates, got {n}")
    half = n // 2
    return [_round(centre * HALF_DECADE**k) for k in range(-half, half + 1)]


def _round(lr: float) -> float:
    """Rates as 3 significant digits, so the same rate from two windows compares (and caches) equal."""
    return float(f"{lr:.3g}")


def best_rate(results: Mapping[float, float]) -> float:
    """The rate with the lowest validation KL (non-finite results, i.e. diverged runs, never win).

    Raises:
        ConfigError: no results, or every run diverged.
    """
    finite = {lr: kl for lr, kl in results.items() if math.isfinite(kl)}
    if not finite:
        raise ConfigError("no learning rate gave a finite validation KL: every run diverged; lower the centre rate")
    return min(finite, key=lambda lr: (finite[lr], lr))


def next_rates(results: Mapping[float, float]) -> list[float]:
    """Rates still to try: one half-decade step beyond the edge when the best tried rate is on it, else []."""
    best = best_rate(results)
    tried = sorted(results)
    if best == tried[0]:
        return [_round(best / HALF_DECADE)]
    if best == tried[-1]:
        return [_round(best * HALF_DECADE)]
    return []


def select_learning_rate(
    objective: Callable[[float], float], centre: float, *, n: int = 5, max_extensions: int = 6
) -> tuple[float, dict[float, float]]:
    """Run the App. E protocol with `objective(lr) -> final validation KL`. Returns (selected rate, all results).

    Raises:
        ConfigError: the best rate is still on an edge after `max_extensions` extensions.
    """
    results: dict[float, float] = {}
    pending = initial_rates(centre, n)
    for _ in range(max_extensions + 1):
        for lr in pending:
            if lr not in results:
                results[lr] = objective(lr)
        pending = next_rates(results)
        if not pending:
            return best_rate(results), results
    raise ConfigError(
        f"the best learning rate is still on the edge of the window after {max_extensions} extensions "
        f"(tried {sorted(results)}); move the centre rate"
    )
