"""Closed-form least-squares solvers for linear KV translators, from Gram statistics only.

Conventions: the design matrix X_E = [X_s]_{s in E} is [n, nu*d_src], the target
Y is [n, d_tgt]; G = X_E^T W X_E is [p, p] with p = nu*d_src and C = X_E^T W Y is
[p, q] with q = d_tgt. Solvers return B ([p, q], fp64) with Y ~ X_E B; the map
handed to the rest of the system is T = B^T ([q, p], fp32), so y_hat = T @ x_E.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from translators.errors import ConfigError, NonFiniteError
from translators.gram import GramStats


def _check_system(gram: torch.Tensor, cross: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate G [p, p] and C [p, q] and return them in fp64, G symmetrised.

    Raises:
        ConfigError: wrong ranks or mismatched sizes.
        NonFiniteError: NaN/Inf in either matrix.
    """
    if not isinstance(gram, torch.Tensor) or gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        shape = list(gram.shape) if isinstance(gram, torch.Tensor) else type(gram).__name__
        raise ConfigError(f"gram must be a square [p, p] tensor, got {shape}")
    if not isinstance(cross, torch.Tensor) or cross.dim() != 2 or cross.shape[0] != gram.shape[0]:
        shape = list(cross.shape) if isinstance(cross, torch.Tensor) else type(cross).__name__
        raise ConfigError(f"cross must be [p, q] with p = {gram.shape[0]} (the gram size), got {shape}")
    g = gram.to(torch.float64)
    c = cross.to(device=g.device, dtype=torch.float64)
    if not bool(torch.isfinite(g).all()) or not bool(torch.isfinite(c).all()):
        raise NonFiniteError("NaN/Inf in the Gram statistics; re-accumulate them from finite captures")
    # Summation order can leave G asymmetric by rounding; eigh reads one triangle only,
    # so symmetrising keeps both triangles' information.
    return (g + g.T) / 2, c


def pinv_solve(gram: torch.Tensor, cross: torch.Tensor, rel_tol: float = 1e-8) -> torch.Tensor:
    """Minimum-norm least-squares solution B = G^+ C via a symmetric eigendecomposition.

    Equals numpy.linalg.lstsq(X, Y)'s minimum-norm solution when G = X^T X, C = X^T Y:
    C lies in range(X^T), so dropping the null-space eigenpairs of G gives the
    pseudo-inverse solution.

    Args:
        gram: [p, p] G = X^T W X.
        cross: [p, q] C = X^T W Y.
        rel_tol: eigenvalues <= rel_tol * max eigenvalue are treated as zero. Eigenvalues
            are squared singular values, so 1e-8 corresponds to a singular-value cutoff 1e-4.

    Returns:
        [p, q] fp64.

    Raises:
        ConfigError: bad shapes or a negative/non-finite rel_tol.
        NonFiniteError: NaN/Inf in G or C.
    """
    if not (isinstance(rel_tol, (int, float)) and math.isfinite(rel_tol) and rel_tol >= 0):
        raise ConfigError(f"rel_tol must be a finite number >= 0, got {rel_tol!r}")
    g, c = _check_system(gram, cross)
    evals, evecs = torch.linalg.eigh(g)
    top = float(evals.max()) if evals.numel() else 0.0
    if top <= 0.0:
        # No signal at all (e.g. no tokens accumulated): the minimum-norm solution is zero.
        return torch.zeros_like(c)
    keep = evals > rel_tol * top
    v = evecs[:, keep]
    return v @ ((v.T @ c) / evals[keep, None])


def ridge_solve(gram: torch.Tensor, cross: torch.Tensor, lam_rel: float) -> torch.Tensor:
    """Ridge solution B = (G + lam_rel * mean(diag G) * I)^{-1} C.

    Scaling lambda by the mean diagonal makes lam_rel independent of the feature scale
    and of the number of tokens.

    Args:
        gram: [p, p] G.
        cross: [p, q] C.
        lam_rel: ridge strength relative to mean(diag G); must be > 0.

    Returns:
        [p, q] fp64.

    Raises:
        ConfigError: lam_rel <= 0 or non-finite, bad shapes, or a zero-trace G.
        NonFiniteError: NaN/Inf in G or C.
    """
    if not (isinstance(lam_rel, (int, float)) and math.isfinite(lam_rel) and lam_rel > 0):
        raise ConfigError(f"lam_rel must be a finite number > 0 (use pinv_solve for no ridge), got {lam_rel!r}")
    g, c = _check_system(gram, cross)
    scale = float(torch.diagonal(g).mean())
    if scale <= 0.0:
        raise ConfigError("the Gram matrix has zero trace (no tokens accumulated?); ridge scale is undefined")
    eye = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.solve(g + lam_rel * scale * eye, c)


def _solve(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """Dispatch: ridge == 0 -> pinv_solve, ridge > 0 -> ridge_solve. Returns [p, q] fp64.

    Raises:
        ConfigError: negative or non-finite ridge.
    """
    if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge >= 0):
        raise ConfigError(f"ridge must be a finite number >= 0 (0 = minimum-norm least squares), got {ridge!r}")
    return pinv_solve(gram, cross) if ridge == 0 else ridge_solve(gram, cross, ridge)


def _check_heads(n_heads_src: int | None, n_heads_tgt: int | None, d_src: int, d_tgt: int) -> int:
    """Validate head counts for a head-wise fit and return the shared count.

    Raises:
        ConfigError: missing, non-positive or unequal counts, or widths not divisible by them.
    """
    if n_heads_src is None or n_heads_tgt is None:
        raise ConfigError("head_wise=True needs n_heads_src and n_heads_tgt (the KV-head counts)")
    for name, h in (("n_heads_src", n_heads_src), ("n_heads_tgt", n_heads_tgt)):
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ConfigError(f"{name} must be a positive integer, got {h!r}")
    if n_heads_src != n_heads_tgt:
        raise ConfigError(
            f"head-wise maps need equal KV-head counts, got {n_heads_src} source heads and "
            f"{n_heads_tgt} target heads; use head_wise=False for this pair"
        )
    if d_src % n_heads_src or d_tgt % n_heads_tgt:
        raise ConfigError(
            f"feature widths d_src={d_src}, d_tgt={d_tgt} are not divisible by the head count {n_heads_src}"
        )
    return n_heads_src


def fit_block(stats: GramStats, target: int, sources: Sequence[int], ridge: float = 0.0) -> torch.Tensor:
    """Full (dense) map from ``sources`` to ``target`` in fp64, T = B^T.

    Returns:
        [d_tgt, nu*d_src] fp64.

    Raises:
        ConfigError: see :func:`fit_map`.
    """
    return _solve(stats.block_gram(sources), stats.block_cross(sources, target), ridge).T


def fit_map(
    stats: GramStats,
    target: int,
    sources: Sequence[int],
    *,
    ridge: float = 0.0,
    head_wise: bool = False,
    n_heads_src: int | None = None,
    n_heads_tgt: int | None = None,
) -> torch.Tensor:
    """Fit the linear map from the concatenated ``sources`` layers to ``target``.

    Args:
        stats: Gram statistics containing ``sources`` as candidates of ``target``.
        target: target layer (0-indexed).
        sources: source layers E (order defines the column blocks).
        ridge: 0 -> minimum-norm least squares; > 0 -> ridge relative to mean(diag G)
            of the system being solved (per head when head_wise).
        head_wise: block-diagonal map: target head h reads only head h of each source layer.
        n_heads_src, n_heads_tgt: KV-head counts, required (and equal) when head_wise.

    Returns:
        T: [d_tgt, nu*d_src] fp32 with y_hat = T @ concat_s x_s. Head-wise maps have
        exact zeros outside the head blocks; column block k (source sources[k]) holds head
        h at columns [k*d_src + h*hd_src, k*d_src + (h+1)*hd_src).

    Raises:
        ConfigError: bad sources/target, negative ridge, or invalid head counts.
        NonFiniteError: NaN/Inf in the statistics.
    """
    if not head_wise:
        return fit_block(stats, target, sources, ridge).to(torch.float32)

    gram = stats.block_gram(sources)
    cross = stats.block_cross(sources, target)
    d_src, d_tgt = stats.d_src, stats.d_tgt
    heads = _check_heads(n_heads_src, n_heads_tgt, d_src, d_tgt)
    hd_src, hd_tgt = d_src // heads, d_tgt // heads
    nu = gram.shape[0] // d_src
    t = torch.zeros(d_tgt, nu * d_src, dtype=torch.float64, device=gram.device)
    for h in range(heads):
        cols = torch.cat(
            [torch.arange(k * d_src + h * hd_src, k * d_src + (h + 1) * hd_src) for k in range(nu)]
        ).to(gram.device)
        rows = slice(h * hd_tgt, (h + 1) * hd_tgt)
        b = _solve(gram[cols][:, cols], cross[cols, rows], ridge)  # [nu*hd_src, hd_tgt]
        t[rows, cols] = b.T
    return t.to(torch.float32)


def relative_residual(stats: GramStats, target: int, sources: Sequence[int], T: torch.Tensor) -> float:
    """r = ||Y - X_E T^T||^2 / ||Y||^2 (weighted), from the statistics alone, in fp64.

    Expands to (tr(Y^T Y) - 2 tr(T X^T Y) + tr(T X^T X T^T)) / tr(Y^T Y). With stats
    accumulated on held-out data and T fitted on training data this is the held-out
    relative error; R^2 = 1 - r.

    Args:
        stats: statistics containing ``sources`` as candidates of ``target``.
        target: target layer.
        sources: source layers E, in the column order of T.
        T: [d_tgt, nu*d_src] map (any float dtype).

    Returns:
        r >= 0 as a Python float.

    Raises:
        ConfigError: T has the wrong shape, or the target has zero energy (r undefined).
        NonFiniteError: T contains NaN/Inf.
    """
    gram = stats.block_gram(sources)
    cross = stats.block_cross(sources, target)
    yy = float(stats.yy[target])
    return _residual(gram, cross, yy, T, target)


def _residual(gram: torch.Tensor, cross: torch.Tensor, yy: float, T: torch.Tensor, target: int) -> float:
    """Relative residual from G [p, p], C [p, q], tr(Y^T Y) and T [q, p]. See relative_residual."""
    expected = (cross.shape[1], gram.shape[0])
    if not isinstance(T, torch.Tensor) or tuple(T.shape) != expected:
        shape = list(T.shape) if isinstance(T, torch.Tensor) else type(T).__name__
        raise ConfigError(f"T must have shape [d_tgt, nu*d_src] = {list(expected)}, got {shape}")
    t = T.to(dtype=torch.float64, device=gram.device)
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteError(f"NaN/Inf in the map for target layer {target}")
    if yy <= 0.0:
        raise ConfigError(
            f"target layer {target} has zero energy (no tokens, zero weights or all-zero features); "
            "the relative residual is undefined"
        )
    cross_term = float((t * cross.T).sum())  # tr(T C)
    quad_term = float(((t @ gram) * t).sum())  # tr(T G T^T)
    r = (yy - 2.0 * cross_term + quad_term) / yy
    # Near-perfect fits cancel almost exactly; rounding can then dip just below zero.
    return max(r, 0.0)
