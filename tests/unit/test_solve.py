"""Closed-form solvers checked against numpy references and known synthetic maps."""

import numpy as np
import pytest
import torch

from translators.errors import ConfigError
from translators.gram import GramStats
from translators.solve import fit_map, pinv_solve, relative_residual, ridge_solve

N_SRC, N_TGT, D_SRC, D_TGT = 6, 4, 16, 12
TRUE_SOURCES = {0: (0, 1), 1: (1, 3), 2: (2, 4), 3: (4, 5)}


def _sources(n, gen):
    """Source layers with residual-stream-like correlation between neighbours."""
    xs = [torch.randn(n, D_SRC, generator=gen, dtype=torch.float64)]
    for _ in range(N_SRC - 1):
        xs.append(0.3 * xs[-1] + 0.95 * torch.randn(n, D_SRC, generator=gen, dtype=torch.float64))
    return xs


def _truth(seed=0, heads=None):
    """True maps T_l [D_TGT, 2*D_SRC]; block-diagonal per head when heads is given."""
    gen = torch.Generator().manual_seed(seed)
    maps = {}
    for t in TRUE_SOURCES:
        T = torch.randn(D_TGT, 2 * D_SRC, generator=gen, dtype=torch.float64) / 4
        if heads is not None:
            mask = torch.zeros_like(T)
            hs, ht = D_SRC // heads, D_TGT // heads
            for h in range(heads):
                for k in range(2):
                    mask[h * ht : (h + 1) * ht, k * D_SRC + h * hs : k * D_SRC + (h + 1) * hs] = 1
            T = T * mask
        maps[t] = T
    return maps


def _sample(maps, n, seed, noise):
    gen = torch.Generator().manual_seed(seed)
    src = _sources(n, gen)
    tgt = []
    for t, srcs in TRUE_SOURCES.items():
        X = torch.cat([src[s] for s in srcs], dim=1)
        tgt.append(X @ maps[t].T + noise * torch.randn(n, D_TGT, generator=gen, dtype=torch.float64))
    return [x.float() for x in src], [y.float() for y in tgt]


def _stats(src, tgt):
    st = GramStats.empty("keys", TRUE_SOURCES, D_SRC, D_TGT)
    st.accumulate(src, tgt)
    return st


def _rel_err(a, b):
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


def test_pinv_solve_matches_lstsq_min_norm_on_rank_deficient_data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 4)) @ rng.standard_normal((4, 10))  # rank 4 of 10 columns
    Y = rng.standard_normal((60, 3))
    ref = np.linalg.lstsq(X, Y, rcond=None)[0]
    got = pinv_solve(torch.from_numpy(X.T @ X), torch.from_numpy(X.T @ Y)).numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-8 * np.abs(ref).max())


def test_pinv_solve_full_rank_matches_solve():
    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((40, 6)), rng.standard_normal((40, 2))
    got = pinv_solve(torch.from_numpy(X.T @ X), torch.from_numpy(X.T @ Y)).numpy()
    np.testing.assert_allclose(got, np.linalg.solve(X.T @ X, X.T @ Y), rtol=1e-10, atol=1e-12)


def test_ridge_solve_matches_explicit_formula():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((30, 8)) * np.arange(1, 9)
    Y = rng.standard_normal((30, 3))
    G, C = X.T @ X, X.T @ Y
    lam = 0.05
    ref = np.linalg.solve(G + lam * np.mean(np.diag(G)) * np.eye(8), C)
    got = ridge_solve(torch.from_numpy(G), torch.from_numpy(C), lam).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lam", [0.0, -1e-3, float("nan")])
def test_ridge_solve_rejects_non_positive_lambda(lam):
    with pytest.raises(ConfigError):
        ridge_solve(torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64), lam)


def test_fit_map_recovers_known_maps():
    maps = _truth(0)
    st = _stats(*_sample(maps, 3000, seed=1, noise=1e-3))
    for t, srcs in TRUE_SOURCES.items():
        T = fit_map(st, t, srcs)
        assert T.dtype == torch.float32 and T.shape == (D_TGT, 2 * D_SRC)
        assert _rel_err(T, maps[t]) < 1e-3
    # A tiny relative ridge barely biases a well-conditioned fit.
    assert _rel_err(fit_map(st, 1, TRUE_SOURCES[1], ridge=1e-6), maps[1]) < 1e-3


def test_head_wise_recovers_block_diagonal_truth_with_exact_zeros():
    heads = 4
    maps = _truth(2, heads=heads)
    st = _stats(*_sample(maps, 3000, seed=3, noise=1e-3))
    for t, srcs in TRUE_SOURCES.items():
        T = fit_map(st, t, srcs, head_wise=True, n_heads_src=heads, n_heads_tgt=heads)
        assert _rel_err(T, maps[t]) < 1e-3
        off_block = maps[t] == 0
        assert torch.equal(T[off_block], torch.zeros(int(off_block.sum())))


def test_head_wise_needs_equal_head_counts():
    st = _stats(*_sample(_truth(0), 50, seed=4, noise=1e-3))
    with pytest.raises(ConfigError, match=r"(?s)4.*2|2.*4"):
        fit_map(st, 0, TRUE_SOURCES[0], head_wise=True, n_heads_src=4, n_heads_tgt=2)
    with pytest.raises(ConfigError):
        fit_map(st, 0, TRUE_SOURCES[0], head_wise=True)


def test_relative_residual_on_held_out_matches_direct_numpy():
    maps = _truth(5)
    train = _stats(*_sample(maps, 800, seed=6, noise=0.1))
    src, tgt = _sample(maps, 300, seed=7, noise=0.1)
    held = _stats(src, tgt)
    # Deliberately fit from a non-true layer set too, so the residual is not just noise.
    for t, srcs in [(1, TRUE_SOURCES[1]), (2, (2, 4)), (0, (1, 0))]:
        T = fit_map(train, t, srcs)
        X = np.concatenate([src[s].double().numpy() for s in srcs], axis=1)
        Y = tgt[t].double().numpy()
        ref = np.sum((Y - X @ T.double().numpy().T) ** 2) / np.sum(Y**2)
        assert relative_residual(held, t, srcs, T) == pytest.approx(ref, rel=1e-9)


def test_relative_residual_rejects_wrong_map_shape():
    st = _stats(*_sample(_truth(0), 50, seed=8, noise=1e-3))
    with pytest.raises(ConfigError):
        relative_residual(st, 0, TRUE_SOURCES[0], torch.zeros(D_TGT, D_SRC))
