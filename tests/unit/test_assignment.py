"""Layer assignment rules checked against brute-force definitions and planted layer choices."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from translators.assignment import (
    ASSIGNMENTS,
    _single_layer_r2,
    all_candidates,
    check_assignment_name,
    greedy,
    r2_assignment,
    relative_depth,
    same_type_candidates,
)
from translators.errors import ConfigError
from translators.gram import GramStats

# ---------------------------------------------------------------------- relative depth


def brute_force_bands(n_src, n_tgt, nu):
    """Straight from the definition: among all valid starts, the band whose midpoint is
    nearest the centre c(l) = l (n_src-1)/(n_tgt-1); ties go to the larger start."""
    bands = {}
    for l in range(n_tgt):
        c = Fraction(l * (n_src - 1), n_tgt - 1) if n_tgt > 1 else Fraction(0)
        best = None
        for a in range(n_src - nu + 1):
            dist = abs(a + Fraction(nu - 1, 2) - c)
            if best is None or dist <= best[0]:  # <= : later (larger) start wins ties
                best = (dist, a)
        bands[l] = tuple(range(best[1], best[1] + nu))
    return bands


@pytest.mark.parametrize("n_src,n_tgt", [(28, 36), (36, 28), (5, 5), (7, 1), (4, 9)])
def test_relative_depth_matches_brute_force(n_src, n_tgt):
    nu = min(4, n_src)
    got = relative_depth(n_src, n_tgt, nu)
    assert got == brute_force_bands(n_src, n_tgt, nu)
    for band in got.values():
        assert len(set(band)) == nu and list(band) == sorted(band)
        assert 0 <= band[0] and band[-1] < n_src


@pytest.mark.parametrize("n_src,n_tgt", [(28, 36), (36, 28)])
def test_relative_depth_end_bands_shift_inward(n_src, n_tgt):
    got = relative_depth(n_src, n_tgt, 4)
    assert got[0] == (0, 1, 2, 3)
    assert got[n_tgt - 1] == tuple(range(n_src - 4, n_src))


def test_relative_depth_nu_one_is_nearest_layer():
    got = relative_depth(3, 5, 1)
    # centres 0, .5, 1, 1.5, 2 rounded half up
    assert got == {0: (0,), 1: (1,), 2: (1,), 3: (2,), 4: (2,)}


def test_relative_depth_errors():
    with pytest.raises(ConfigError, match=r"(?s)7.*5|5.*7"):
        relative_depth(5, 8, 7)
    with pytest.raises(ConfigError):
        relative_depth(5, 8, 0)
    with pytest.raises(ConfigError):
        relative_depth(3, 3, 1, ["full_attention"] * 3, None)
    with pytest.raises(ConfigError):  # target type absent from the source
        relative_depth(2, 2, 1, ["full_attention"] * 2, ["sliding_attention", "full_attention"])


def gemma_types(n):
    """5 sliding-window layers, then 1 global layer, repeated."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


@pytest.mark.parametrize("nu", [1, 3, 4])
def test_relative_depth_with_types_stays_within_type(nu):
    st, tt = gemma_types(26), gemma_types(34)
    got = relative_depth(26, 34, nu, st, tt)
    assert sorted(got) == list(range(34))
    for l, band in got.items():
        assert len(set(band)) == nu
        assert all(st[s] == tt[l] for s in band)
    # Within each type the rule is the untyped rule on the type's sub-sequence.
    for kind in ("sliding_attention", "full_attention"):
        src_idx = [i for i, k in enumerate(st) if k == kind]
        tgt_idx = [i for i, k in enumerate(tt) if k == kind]
        sub = brute_force_bands(len(src_idx), len(tgt_idx), nu)
        for j, l in enumerate(tgt_idx):
            assert got[l] == tuple(src_idx[i] for i in sub[j])


def test_relative_depth_typed_nu_exceeding_type_count():
    with pytest.raises(ConfigError, match=r"(?s)5.*4"):
        relative_depth(26, 34, 5, gemma_types(26), gemma_types(34))  # only 4 global source layers


def test_same_type_candidates():
    st, tt = gemma_types(12), gemma_types(7)
    cands = same_type_candidates(st, tt)
    assert cands[5] == (5, 11)
    assert cands[0] == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert all_candidates(3, 2) == {0: (0, 1, 2), 1: (0, 1, 2)}


# ---------------------------------------------------------------------- data-driven rules

N_SRC, N_TGT, D_SRC, D_TGT = 6, 4, 16, 12
PLANTED = {0: (0, 1), 1: (1, 3), 2: (2, 4), 3: (4, 5)}


def planted_data(n, noise, seed):
    """Targets are known linear maps of two chosen, mutually correlated source layers.

    Returns fp32 per-layer lists src [n, D_SRC] and tgt [n, D_TGT]."""
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randn(n, D_SRC, generator=gen, dtype=torch.float64)]
    for _ in range(N_SRC - 1):
        src.append(0.3 * src[-1] + 0.95 * torch.randn(n, D_SRC, generator=gen, dtype=torch.float64))
    tgt = []
    for t in range(N_TGT):
        X = torch.cat([src[s] for s in PLANTED[t]], dim=1)
        T = torch.randn(D_TGT, 2 * D_SRC, generator=gen, dtype=torch.float64) / 4
        tgt.append(X @ T.T + noise * torch.randn(n, D_TGT, generator=gen, dtype=torch.float64))
    return [x.float() for x in src], [y.float() for y in tgt]


def planted_stats(n=3000, noise=1e-3, seed=0):
    stats = GramStats.empty("values", all_candidates(N_SRC, N_TGT), D_SRC, D_TGT)
    stats.accumulate(*planted_data(n, noise, seed))
    return stats


@pytest.fixture(scope="module")
def stats():
    return planted_stats()


def test_greedy_recovers_planted_layers(stats):
    got = greedy(stats, 2)
    assert {t: set(v) for t, v in got.items()} == {t: set(v) for t, v in PLANTED.items()}
    assert all(len(v) == 2 for v in got.values())


def test_r2_recovers_planted_layers(stats):
    got = r2_assignment(stats, 2)
    assert {t: set(v) for t, v in got.items()} == {t: set(v) for t, v in PLANTED.items()}


def test_r2_assignment_orders_by_decreasing_r2(stats):
    for t, srcs in r2_assignment(stats, 4).items():
        r2 = _single_layer_r2(stats, t)
        vals = [r2[s] for s in srcs]
        assert vals == sorted(vals, reverse=True)


def test_single_layer_r2_matches_lstsq():
    """The R² the r2 assignment ranks candidates by is the single-layer least-squares R²."""
    src, tgt = planted_data(400, noise=0.1, seed=1)
    stats = GramStats.empty("values", all_candidates(N_SRC, N_TGT), D_SRC, D_TGT)
    stats.accumulate(src, tgt)
    src = [x.double().numpy() for x in src]
    tgt = [y.double().numpy() for y in tgt]
    for t in range(N_TGT):
        r2_of = _single_layer_r2(stats, t)
        assert sorted(r2_of) == list(range(N_SRC))
        for s in range(N_SRC):
            # Independent reference: numpy least squares on the design matrix itself.
            B = np.linalg.lstsq(src[s], tgt[t], rcond=None)[0]
            r2 = 1 - np.sum((tgt[t] - src[s] @ B) ** 2) / np.sum(tgt[t] ** 2)
            assert r2_of[s] == pytest.approx(r2, rel=1e-8, abs=1e-10)


def test_nu_exceeding_candidates_raises(stats):
    with pytest.raises(ConfigError):
        greedy(stats, N_SRC + 1)
    with pytest.raises(ConfigError):
        r2_assignment(stats, 0)


def test_assignment_names():
    for name in ASSIGNMENTS:
        assert check_assignment_name(name) == name
    with pytest.raises(ConfigError, match="did you mean 'greedy'"):
        check_assignment_name("gredy")
    with pytest.raises(ConfigError):
        check_assignment_name("zzzzzz")
