"""Layer assignment: which source layers each target layer's translator reads.

Layers are 0-indexed. Every function returns ``{target_layer: (source_layer, ...)}``.
The data-driven rules (greedy, r2) work from :class:`GramStats` alone, so choosing an
assignment never needs a second pass over the data.
"""

from __future__ import annotations

import difflib
import math
import operator
from fractions import Fraction
from typing import Hashable, Sequence

from translators.errors import ConfigError
from translators.gram import GramStats
from translators.solve import fit_block, relative_residual

ASSIGNMENTS = ("depth", "greedy", "r2")

Assignment = dict[int, tuple[int, ...]]  # target layer -> source layers it reads (ordered as the map's blocks)


def check_assignment_name(name: str) -> str:
    """Return ``name`` if it is a known assignment rule.

    Raises:
        ConfigError: unknown name, with a "did you mean" suggestion when one is close.
    """
    if name in ASSIGNMENTS:
        return name
    close = difflib.get_close_matches(str(name), ASSIGNMENTS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown assignment {name!r}{hint} (choose one of {', '.join(ASSIGNMENTS)})")


def _check_count(value: object, what: str) -> int:
    """Return ``value`` as an int >= 1. Raises: ConfigError otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(n)


# ---------------------------------------------------------------------- layer types


def _check_types(
    n_src: int, n_tgt: int, src_types: Sequence[Hashable] | None, tgt_types: Sequence[Hashable] | None
) -> tuple[list[Hashable], list[Hashable]]:
    """Per-layer attention types; None on both sides means one shared type.

    Raises:
        ConfigError: only one side typed, or a type list of the wrong length.
    """
    if (src_types is None) != (tgt_types is None):
        raise ConfigError("give layer types for both models or for neither (src_types and tgt_types)")
    if src_types is None:
        return [None] * n_src, [None] * n_tgt
    if len(src_types) != n_src:
        raise ConfigError(f"src_types has {len(src_types)} entries but the source model has {n_src} layers")
    if len(tgt_types) != n_tgt:
        raise ConfigError(f"tgt_types has {len(tgt_types)} entries but the target model has {n_tgt} layers")
    return list(src_types), list(tgt_types)


def _by_type(
    src_types: list[Hashable], tgt_types: list[Hashable]
) -> list[tuple[Hashable, list[int], list[int]]]:
    """Group layers by type: [(type, target layers, source layers)] in order of first target use.

    Raises:
        ConfigError: a target type that no source layer has.
    """
    groups = []
    for kind in dict.fromkeys(tgt_types):  # dict keeps first-seen order
        tgt = [l for l, k in enumerate(tgt_types) if k == kind]
        src = [s for s, k in enumerate(src_types) if k == kind]
        if not src:
            raise ConfigError(
                f"target layers {tgt} have attention type {kind!r}, which no source layer has; "
                f"source types: {sorted(set(map(str, src_types)))}"
            )
        groups.append((kind, tgt, src))
    return groups


def corresponding_types(
    src_types: Sequence[Hashable], tgt_types: Sequence[Hashable]
) -> tuple[list[Hashable] | None, list[Hashable] | None]:
    """The per-layer types an assignment must respect, or (None, None) when it may ignore them.

    Pairs that both mix sliding and global layers (Gemma-3 generations) map sliding to sliding and global to global
    (the same-type rule). When the two models' type sets differ (SmolLM2: all global; Gemma-3: 5 sliding : 1 global)
    the types do not correspond: the same-type rule would refuse the pair (no sliding source layer) or send every
    source layer into the target's few global layers. Any source layer may then feed any target layer, relative
    depth or the data-driven rules choosing; a sliding target layer reads only its window of a translated cache, as
    of any other. Measured on SmolLM2 ↔ Gemma-3-270M: README, "Cross-tokenizer pairs".
    """
    if set(src_types) == set(tgt_types):
        return list(src_types), list(tgt_types)
    return None, None


def same_type_candidates(src_types: Sequence[Hashable], tgt_types: Sequence[Hashable]) -> Assignment:
    """Every source layer of the target layer's attention type, per target layer.

    Intended as GramStats candidates for the greedy and r2 rules.

    Raises:
        ConfigError: a target type that no source layer has.
    """
    if src_types is None or tgt_types is None:
        raise ConfigError("same_type_candidates needs both type lists; use all_candidates for untyped models")
    return all_candidates(len(src_types), len(tgt_types), src_types, tgt_types)


def all_candidates(
    n_src: int,
    n_tgt: int,
    src_types: Sequence[Hashable] | None = None,
    tgt_types: Sequence[Hashable] | None = None,
) -> Assignment:
    """Candidates per target layer: all source layers of the same type (all layers when untyped).

    Raises:
        ConfigError: bad counts, mismatched type lists, or a target type no source layer has.
    """
    n_src = _check_count(n_src, "n_src")
    n_tgt = _check_count(n_tgt, "n_tgt")
    st, tt = _check_types(n_src, n_tgt, src_types, tgt_types)
    out: Assignment = {}
    for _, tgt, src in _by_type(st, tt):
        for l in tgt:
            out[l] = tuple(src)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------- relative depth


def _depth_starts(n_src: int, n_tgt: int, nu: int) -> list[int]:
    """First layer of each target's nu-band, within one homogeneous layer sequence.

    Centre c(l) = l (n_src-1)/(n_tgt-1); the band [a, a+nu-1] whose midpoint is nearest
    c (round half up), clamped into [0, n_src-nu]. Exact rationals avoid float ties
    landing on the wrong side.
    """
    starts = []
    for l in range(n_tgt):
        c = Fraction(l * (n_src - 1), n_tgt - 1) if n_tgt > 1 else Fraction(0)
        a = math.floor(c - Fraction(nu - 1, 2) + Fraction(1, 2))
        starts.append(min(max(a, 0), n_src - nu))
    return starts


def relative_depth(
    n_src: int,
    n_tgt: int,
    nu: int,
    src_types: Sequence[Hashable] | None = None,
    tgt_types: Sequence[Hashable] | None = None,
) -> Assignment:
    """Relative-depth assignment: each target reads nu consecutive source layers at its depth.

    With layer types (e.g. "sliding_attention" / "full_attention"), the rule is applied
    within each type's sub-sequence and mapped back to absolute indices, so a target
    only reads source layers of its own attention type.

    Returns:
        {target layer: nu source layers, ascending}.

    Raises:
        ConfigError: nu < 1; nu larger than the number of source layers (of a type);
            mismatched type lists; a target type no source layer has.
    """
    n_src = _check_count(n_src, "n_src")
    n_tgt = _check_count(n_tgt, "n_tgt")
    nu = _check_count(nu, "nu (source layers per target layer)")
    st, tt = _check_types(n_src, n_tgt, src_types, tgt_types)
    out: Assignment = {}
    for kind, tgt, src in _by_type(st, tt):
        if nu > len(src):
            of_type = "" if kind is None else f" of type {kind!r}"
            raise ConfigError(
                f"nu={nu} source layers per target exceeds the {len(src)} source layers{of_type}; "
                f"choose nu <= {len(src)}"
            )
        for l, a in zip(tgt, _depth_starts(len(src), len(tgt), nu)):
            out[l] = tuple(src[a : a + nu])
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------- data-driven rules


def _check_nu_for(stats: GramStats, nu: object) -> int:
    """Validate nu against every target's candidate count.

    Raises:
        ConfigError: nu < 1 or more than some target's candidates.
    """
    nu = _check_count(nu, "nu (source layers per target layer)")
    for t, cands in stats.candidates.items():
        if nu > len(cands):
            raise ConfigError(
                f"nu={nu} exceeds the {len(cands)} candidate source layers of target layer {t}; "
                f"choose nu <= {len(cands)} or widen the candidates"
            )
    return nu


def greedy(stats: GramStats, nu: int, ridge: float = 1e-3) -> Assignment:
    """Greedy forward selection of source layers per target layer.

    S^0 = {}; for j = 1..nu add the candidate s not in S minimising the relative residual
    r(S u {s}) of the ridge fit on the full block X_{S u {s}} (re-solved at every step,
    ridge relative to that block's mean diagonal). Ties go to the earlier candidate.

    Returns:
        {target layer: nu source layers in selection order}.

    Raises:
        ConfigError: bad nu or ridge (ridge 0 means minimum-norm least squares).
    """
    nu = _check_nu_for(stats, nu)
    out: Assignment = {}
    for t, cands in stats.candidates.items():
        chosen: list[int] = []
        for _ in range(nu):
            best, best_r = None, math.inf
            for s in cands:
                if s in chosen:
                    continue
                trial = chosen + [s]
                r = relative_residual(stats, t, trial, fit_block(stats, t, trial, ridge))
                if r < best_r:
                    best, best_r = s, r
            if best is None:
                # Every residual was NaN: the statistics are unusable, not a tie.
                raise ConfigError(f"greedy selection failed for target layer {t}: no finite residual")
            chosen.append(best)
        out[t] = tuple(chosen)
    return out


def _single_layer_r2(stats: GramStats, target: int) -> dict[int, float]:
    """R^2 = 1 - r({s}) of the least-squares fit from each candidate s alone."""
    return {
        s: 1.0 - relative_residual(stats, target, [s], fit_block(stats, target, [s], 0.0))
        for s in stats.candidates[target]
    }


def r2_assignment(stats: GramStats, nu: int) -> Assignment:
    """Keep, per target layer, the nu candidates with the highest single-layer R^2.

    Returns:
        {target layer: nu source layers by decreasing R^2 (ties: lower layer first)}.

    Raises:
        ConfigError: bad nu.
    """
    nu = _check_nu_for(stats, nu)
    out: Assignment = {}
    for t in stats.candidates:
        r2 = _single_layer_r2(stats, t)
        ranked = sorted(r2, key=lambda s: (-r2[s], s))
        out[t] = tuple(ranked[:nu])
    return out
