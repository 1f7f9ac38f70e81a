"""Streaming, mergeable fp64 second moments for fitting linear KV translators.

A target layer l's keys (or values) Y_l in R^{n x d_tgt} are approximated by
X_E B, where X_E = [X_s]_{s in E} concatenates source-layer features
(X_s in R^{n x d_src}). Every closed-form fit and residual of stage 1 needs only
the sums X_s^T W X_s', X_s^T W Y_l and tr(Y_l^T W Y_l), so :class:`GramStats`
keeps exactly those sums and nothing per-sample: memory is independent of how
many tokens were accumulated, and partial statistics computed on disjoint shards
add up to the one-pass result.

With token identity every source layer's features are [X_s | E] (E in R^{n x d_tok},
the target's embedding of each token, `translators.token_identity`). The sums that
involve E are the same for every source layer, so they are kept once (E^T W X_s,
E^T W E, E^T W Y_l) and the block views assemble them wherever a layer's features
repeat E: memory grows by d_tok·(d_src + d_tok + d_tgt) per layer rather than by a
factor ((d_src + d_tok) / d_src)^2.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field
from os import PathLike
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from translators.errors import ConfigError, NonFiniteError, PairMismatchError
from translators.objects import OBJECT_NAMES, CacheObject

# Bumped whenever the on-disk layout changes, so old files fail loudly instead of
# being misread.
FORMAT = "kvlingo.gram.v2"  # v2: the token-identity sums are kept once (te, ee, ey)
_META_KEY = "kvlingo_gram"

Candidates = dict[int, tuple[int, ...]]


def _check_layer(value: object, what: str) -> int:
    """Return ``value`` as a layer index. Raises: ConfigError if not an int >= 0."""
    # bool is an int subclass; True as a layer index is almost surely a bug.
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a non-negative integer layer index (0-indexed), got {value!r}")
    try:
        # operator.index accepts numpy integers too, but not floats like 2.0.
        idx = operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be a non-negative integer layer index (0-indexed), got {value!r}") from None
    if idx < 0:
        raise ConfigError(f"{what} must be a non-negative integer layer index (0-indexed), got {value!r}")
    return int(idx)


def normalize_candidates(candidates: object) -> Candidates:
    """Validate a target -> candidate-source-layers mapping and return a canonical copy.

    Targets are sorted; each candidate tuple keeps its given order.

    Raises:
        ConfigError: empty mapping, empty candidate list, negative/non-int layer,
            or a source layer listed twice for one target.
    """
    if not isinstance(candidates, dict) or not candidates:
        raise ConfigError("candidates must be a non-empty dict {target_layer: (source_layer, ...)}")
    out: Candidates = {}
    targets = {_check_layer(tgt, "target layer"): tgt for tgt in candidates}
    for t in sorted(targets):
        srcs = candidates[targets[t]]
        if isinstance(srcs, int) or not isinstance(srcs, Sequence) or len(srcs) == 0:
            raise ConfigError(f"target layer {t} needs a non-empty sequence of candidate source layers, got {srcs!r}")
        norm = tuple(_check_layer(s, f"candidate source layer of target {t}") for s in srcs)
        if len(set(norm)) != len(norm):
            raise ConfigError(f"target layer {t} lists a source layer twice: {norm}")
        out[t] = norm
    return out


def _pairs(candidates: Candidates) -> list[tuple[int, int]]:
    """All (s, s') with s <= s' that co-occur in some target's candidates, sorted."""
    pairs: set[tuple[int, int]] = set()
    for srcs in candidates.values():
        for s in srcs:
            for s2 in srcs:
                if s <= s2:
                    pairs.add((s, s2))
    return sorted(pairs)


@dataclass
class GramStats:
    """Second moments for one cache object (e.g. "keys" or "values") over the candidate layer pairs."""

    side: str  # the object's name
    candidates: dict[int, tuple[int, ...]]  # target layer -> candidate source layers (0-indexed)
    xx: dict[tuple[int, int], torch.Tensor]  # (s, s'), s <= s': [d_src, d_src] fp64 = sum_i w_i x_{s,i} x_{s',i}^T
    xy: dict[tuple[int, int], torch.Tensor]  # (s, l): [d_src, d_tgt] fp64 = sum_i w_i x_{s,i} y_{l,i}^T
    yy: dict[int, torch.Tensor]  # l: scalar fp64 = sum_i w_i ||y_{l,i}||^2
    weight_sum: float  # sum_i w_i  (== number of tokens when unweighted)
    n_tokens: int
    # Token identity (d_tok > 0): e_i is appended to every source layer's features; its sums are kept once.
    te: dict[int, torch.Tensor] = field(default_factory=dict)  # s: [d_tok, d_src] = sum_i w_i e_i x_{s,i}^T
    ee: torch.Tensor | None = None  # [d_tok, d_tok] = sum_i w_i e_i e_i^T; None without token identity
    ey: dict[int, torch.Tensor] = field(default_factory=dict)  # l: [d_tok, d_tgt] = sum_i w_i e_i y_{l,i}^T

    # ------------------------------------------------------------------ construction

    @classmethod
    def empty(
        cls,
        side: str | CacheObject,
        candidates: dict[int, Sequence[int]],
        d_src: int,
        d_tgt: int,
        *,
        d_tok: int = 0,
        device: torch.device | str = "cpu",
    ) -> "GramStats":
        """Zero statistics for ``candidates``.

        Args:
            side: the cache object, or the name of one an adapter defines (`objects.OBJECT_NAMES`, e.g.
                "keys" or "values").
            candidates: target layer -> candidate source layers (0-indexed).
            d_src, d_tgt: feature widths of one source / target layer.
            d_tok: width of the token features appended to every source layer (token identity), 0 for none.
            device: where the sums live (inputs are moved there before the matmul).

        Raises:
            ConfigError: unknown side, bad candidates, or non-positive widths.
        """
        if isinstance(side, CacheObject):
            side = side.name
        elif side not in OBJECT_NAMES:
            raise ConfigError(f"side must be a CacheObject or one of {OBJECT_NAMES}, got {side!r}")
        for name, d in (("d_src", d_src), ("d_tgt", d_tgt)):
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ConfigError(f"{name} must be a positive integer feature width, got {d!r}")
        if isinstance(d_tok, bool) or not isinstance(d_tok, int) or d_tok < 0:
            raise ConfigError(f"d_tok must be a non-negative integer feature width, got {d_tok!r}")
        cands = normalize_candidates(candidates)
        f64 = dict(dtype=torch.float64, device=device)
        xx = {p: torch.zeros(d_src, d_src, **f64) for p in _pairs(cands)}
        xy = {(s, t): torch.zeros(d_src, d_tgt, **f64) for t, srcs in cands.items() for s in srcs}
        yy = {t: torch.zeros((), **f64) for t in cands}
        stats = cls(side=side, candidates=cands, xx=xx, xy=xy, yy=yy, weight_sum=0.0, n_tokens=0)
        if d_tok:
            stats.te = {s: torch.zeros(d_tok, d_src, **f64) for s in stats.source_layers}
            stats.ee = torch.zeros(d_tok, d_tok, **f64)
            stats.ey = {t: torch.zeros(d_tok, d_tgt, **f64) for t in cands}
        return stats

    # ------------------------------------------------------------------ properties

    @property
    def d_src(self) -> int:
        """Feature width of one source layer."""
        return next(iter(self.xy.values())).shape[0]

    @property
    def d_tgt(self) -> int:
        """Feature width of one target layer."""
        return next(iter(self.xy.values())).shape[1]

    @property
    def d_tok(self) -> int:
        """Width of the token features appended to every source layer (0 without token identity)."""
        return 0 if self.ee is None else self.ee.shape[0]

    @property
    def d_in(self) -> int:
        """Features one source layer contributes to a map's input: d_src + d_tok."""
        return self.d_src + self.d_tok

    @property
    def nbytes(self) -> int:
        """Bytes of all the sums (what a shard stores)."""
        parts = [*self.xx.values(), *self.xy.values(), *self.yy.values(), *self.te.values(), *self.ey.values()]
        return sum(t.numel() * t.element_size() for t in parts + ([] if self.ee is None else [self.ee]))

    @property
    def device(self) -> torch.device:
        """Device holding the sums."""
        return next(iter(self.yy.values())).device

    @property
    def source_layers(self) -> tuple[int, ...]:
        """Sorted union of all candidate source layers."""
        return tuple(sorted({s for srcs in self.candidates.values() for s in srcs}))

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Sorted target layers."""
        return tuple(sorted(self.candidates))

    # ------------------------------------------------------------------ accumulation

    def _features(self, tensors: Sequence[torch.Tensor], layer: int, kind: str, width: int) -> torch.Tensor:
        """Fetch ``tensors[layer]`` ([n, width]) as fp64 on the stats' device.

        Raises:
            ConfigError: missing layer, wrong rank or width.
            NonFiniteError: the layer holds NaN/Inf.
        """
        if layer >= len(tensors):
            raise ConfigError(
                f"{kind} layer {layer} is needed by the candidates but only {len(tensors)} {kind} layers "
                f"of {self.side} were given; pass one tensor per layer, indexed by layer"
            )
        x = tensors[layer]
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"{kind} layer {layer} {self.side} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != width:
            raise ConfigError(
                f"{kind} layer {layer} {self.side} must have shape [n, {width}], got {list(x.shape)}; "
                "flatten heads into the feature axis and positions into the first axis"
            )
        x = x.to(device=self.device, dtype=torch.float64)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(f"NaN/Inf in {kind} layer {layer} {self.side}")
        return x

    def accumulate(
        self,
        src: Sequence[torch.Tensor],
        tgt: Sequence[torch.Tensor],
        weights: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of aligned positions to the sums (in place).

        Args:
            src: one tensor per source layer, ``src[s]`` of shape [n, d_src]; only
                candidate layers are read.
            tgt: one tensor per target layer, ``tgt[l]`` of shape [n, d_tgt]; only
                target layers in ``candidates`` are read.
            weights: optional [n] non-negative per-position weights, e.g. the mean
                attention a position receives (attention-weighted norm
                ||D||^2_attn = sum_i a_i ||d_i||^2). None means all ones.
            tokens: [n, d_tok] token features appended to every source layer (token identity); required
                exactly when the statistics were made with d_tok > 0.

        Raises:
            ConfigError: wrong number of layers, shapes, or position counts; negative weights; token
                features given without d_tok or missing with it.
            NonFiniteError: NaN/Inf in an input layer or in the weights.
        """
        if (tokens is None) != (self.d_tok == 0):
            raise ConfigError(f"these {self.side} statistics {'hold' if self.d_tok else 'do not hold'} token "
                              f"features (d_tok={self.d_tok}): pass tokens exactly when they do")
        xs = {s: self._features(src, s, "source", self.d_src) for s in self.source_layers}
        ys = {t: self._features(tgt, t, "target", self.d_tgt) for t in self.target_layers}
        n = self._common_length(xs, ys)
        w = self._weights(weights, n)
        if tokens is not None:
            e = self._features([tokens], 0, "token", self.d_tok)
            if e.shape[0] != n:
                raise ConfigError(f"token features hold {e.shape[0]} positions, the layers {n}")
            ew = e if w is None else e * w[:, None]
            for s, acc in self.te.items():
                acc += ew.T @ xs[s]
            self.ee += ew.T @ e
            for t, acc in self.ey.items():
                acc += ew.T @ ys[t]

        # Weight one factor only: sum_i w_i a_i b_i^T = (w * A)^T B.
        xw = {s: x if w is None else x * w[:, None] for s, x in xs.items()}
        for (s, s2), acc in self.xx.items():
            acc += xw[s].T @ xs[s2]
        for (s, t), acc in self.xy.items():
            acc += xw[s].T @ ys[t]
        for t, acc in self.yy.items():
            sq = ys[t].square().sum(dim=1)
            acc += sq.sum() if w is None else (w * sq).sum()
        self.weight_sum += float(n) if w is None else float(w.sum())
        self.n_tokens += n

    @staticmethod
    def _common_length(xs: dict[int, torch.Tensor], ys: dict[int, torch.Tensor]) -> int:
        """Number of positions shared by all read layers. Raises: ConfigError if they differ."""
        lengths = {("source", s): x.shape[0] for s, x in xs.items()}
        lengths.update({("target", t): y.shape[0] for t, y in ys.items()})
        distinct = set(lengths.values())
        if len(distinct) != 1:
            detail = ", ".join(f"{k} {l}: {n}" for (k, l), n in lengths.items())
            raise ConfigError(f"all layers must hold the same number of aligned positions, got {detail}")
        return distinct.pop()

    def _weights(self, weights: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Validate per-position weights and return them as fp64 [n] (or None).

        Raises:
            ConfigError: wrong shape or negative entries.
            NonFiniteError: NaN/Inf weights.
        """
        if weights is None:
            return None
        if not isinstance(weights, torch.Tensor) or weights.dim() != 1 or weights.shape[0] != n:
            shape = list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ConfigError(f"weights must be a 1-D tensor of length {n} (one per position), got {shape}")
        w = weights.to(device=self.device, dtype=torch.float64)
        if not bool(torch.isfinite(w).all()):
            raise NonFiniteError(f"NaN/Inf in the position weights for {self.side}")
        if bool((w < 0).any()):
            raise ConfigError("weights must be non-negative (they weight squared errors)")
        return w

    # ------------------------------------------------------------------ merging

    def _check_compatible(self, other: "GramStats") -> None:
        """Raises: PairMismatchError if ``other`` sums a different configuration."""
        if not isinstance(other, GramStats):
            raise PairMismatchError(f"can only merge GramStats with GramStats, got {type(other).__name__}")
        if other.side != self.side:
            raise PairMismatchError(f"cannot merge {self.side} statistics with {other.side} statistics")
        if other.candidates != self.candidates:
            raise PairMismatchError(
                "cannot merge statistics over different candidate layers; "
                "accumulate every shard with the same candidates"
            )
        if (other.d_src, other.d_tgt, other.d_tok) != (self.d_src, self.d_tgt, self.d_tok):
            raise PairMismatchError(
                f"cannot merge statistics of widths (d_src={self.d_src}, d_tgt={self.d_tgt}, d_tok={self.d_tok}) "
                f"and (d_src={other.d_src}, d_tgt={other.d_tgt}, d_tok={other.d_tok}); they come from different "
                "model pairs or token-identity settings"
            )

    def merge(self, other: "GramStats") -> "GramStats":
        """Exact sum of two statistics over disjoint samples; neither input is modified.

        Raises:
            PairMismatchError: different side, candidates or widths.
        """
        self._check_compatible(other)
        dev = self.device
        return GramStats(
            side=self.side,
            candidates=dict(self.candidates),
            xx={k: v + other.xx[k].to(dev) for k, v in self.xx.items()},
            xy={k: v + other.xy[k].to(dev) for k, v in self.xy.items()},
            yy={k: v + other.yy[k].to(dev) for k, v in self.yy.items()},
            weight_sum=self.weight_sum + other.weight_sum,
            n_tokens=self.n_tokens + other.n_tokens,
            te={k: v + other.te[k].to(dev) for k, v in self.te.items()},
            ee=None if self.ee is None else self.ee + other.ee.to(dev),
            ey={k: v + other.ey[k].to(dev) for k, v in self.ey.items()},
        )

    def __add__(self, other: "GramStats") -> "GramStats":
        return self.merge(other)

    # ------------------------------------------------------------------ block views

    def _check_sources(self, sources: Sequence[int]) -> tuple[int, ...]:
        """Validate a source-layer selection. Raises: ConfigError if empty or repeated."""
        if isinstance(sources, int) or not isinstance(sources, Sequence) or len(sources) == 0:
            raise ConfigError(f"sources must be a non-empty sequence of source layers, got {sources!r}")
        srcs = tuple(_check_layer(s, "source layer") for s in sources)
        if len(set(srcs)) != len(srcs):
            raise ConfigError(f"sources must be distinct, got {srcs}")
        return srcs

    def block_gram(self, sources: Sequence[int]) -> torch.Tensor:
        """X_E^T W X_E for E = ``sources`` (in the given order); with token identity each layer's features are
        [x_s | e], so the token sums appear once per layer.

        Returns:
            [nu*d_in, nu*d_in] fp64, block (i, j) = sum_i w x_{E_i} x_{E_j}^T.

        Raises:
            ConfigError: empty/repeated sources, or a pair that was never accumulated
                because the two layers are not candidates of a common target.
        """
        srcs = self._check_sources(sources)
        rows = []
        for s in srcs:
            row = []
            for s2 in srcs:
                key = (min(s, s2), max(s, s2))
                if key not in self.xx:
                    raise ConfigError(
                        f"source layers {key[0]} and {key[1]} are not candidates of a common target "
                        f"layer, so their cross moment was not accumulated; candidates: {self.candidates}"
                    )
                # Only s <= s' is stored; the other triangle is its transpose.
                block = self.xx[key] if s <= s2 else self.xx[key].T
                if self.d_tok:  # [x_s | e]^T W [x_s2 | e]
                    block = torch.cat([torch.cat([block, self.te[s].T], dim=1),
                                       torch.cat([self.te[s2], self.ee], dim=1)], dim=0)
                row.append(block)
            rows.append(torch.cat(row, dim=1))
        return torch.cat(rows, dim=0)

    def block_cross(self, sources: Sequence[int], target: int) -> torch.Tensor:
        """X_E^T W Y_target for E = ``sources`` (in the given order).

        Returns:
            [nu*d_in, d_tgt] fp64 (with token identity each layer's rows are x_s's, then e's).

        Raises:
            ConfigError: unknown target, or a source that is not a candidate of it.
        """
        srcs = self._check_sources(sources)
        t = self._check_target(target)
        missing = [s for s in srcs if (s, t) not in self.xy]
        if missing:
            raise ConfigError(
                f"source layers {missing} are not candidates of target layer {t} "
                f"(candidates: {self.candidates[t]})"
            )
        if self.d_tok:
            return torch.cat([part for s in srcs for part in (self.xy[(s, t)], self.ey[t])], dim=0)
        return torch.cat([self.xy[(s, t)] for s in srcs], dim=0)

    def _check_target(self, target: int) -> int:
        """Raises: ConfigError if ``target`` has no statistics."""
        t = _check_layer(target, "target layer")
        if t not in self.candidates:
            raise ConfigError(f"target layer {t} has no statistics; known targets: {list(self.candidates)}")
        return t

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | PathLike) -> None:
        """Write the sums to a safetensors file (no pickle); metadata holds the configuration."""
        tensors: dict[str, torch.Tensor] = {}
        for (s, s2), v in self.xx.items():
            tensors[f"xx.{s}.{s2}"] = v.detach().cpu().contiguous()
        for (s, t), v in self.xy.items():
            tensors[f"xy.{s}.{t}"] = v.detach().cpu().contiguous()
        for t, v in self.yy.items():
            tensors[f"yy.{t}"] = v.detach().cpu().contiguous()
        for s, v in self.te.items():
            tensors[f"te.{s}"] = v.detach().cpu().contiguous()
        if self.ee is not None:
            tensors["ee"] = self.ee.detach().cpu().contiguous()
        for t, v in self.ey.items():
            tensors[f"ey.{t}"] = v.detach().cpu().contiguous()
        meta = {
            "format": FORMAT,
            "side": self.side,
            # JSON object keys must be strings; load() converts them back.
            "candidates": {str(t): list(srcs) for t, srcs in self.candidates.items()},
            # repr round-trips a float exactly, keeping save/load bit-exact.
            "weight_sum": repr(float(self.weight_sum)),
            "n_tokens": int(self.n_tokens),
        }
        save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta)})

    @classmethod
    def load(cls, path: str | PathLike, *, device: torch.device | str = "cpu") -> "GramStats":
        """Read statistics written by :meth:`save`.

        Raises:
            PairMismatchError: the file is not a kvlingo GramStats file of this format,
                or its tensors do not match its recorded candidates.
        """
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None:
                raise PairMismatchError(f"{path} is not a kvlingo GramStats file (no {_META_KEY!r} metadata)")
            meta = json.loads(raw)
            if meta.get("format") != FORMAT:
                raise PairMismatchError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
            tensors = {k: f.get_tensor(k).to(device) for k in f.keys()}
        if meta.get("side") not in OBJECT_NAMES:
            raise PairMismatchError(f"{path}: unknown side {meta.get('side')!r}")
        cands = normalize_candidates({int(t): tuple(srcs) for t, srcs in meta["candidates"].items()})
        xx, xy, yy, te, ey = {}, {}, {}, {}, {}
        for name, v in tensors.items():
            kind, *idx = name.split(".")
            if kind == "xx":
                xx[(int(idx[0]), int(idx[1]))] = v
            elif kind == "xy":
                xy[(int(idx[0]), int(idx[1]))] = v
            elif kind == "yy":
                yy[int(idx[0])] = v
            elif kind == "te":
                te[int(idx[0])] = v
            elif kind == "ey":
                ey[int(idx[0])] = v
        ee = tensors.get("ee")
        expected_xy = {(s, t) for t, srcs in cands.items() for s in srcs}
        sources = {s for srcs in cands.values() for s in srcs}
        tokens_ok = (not te and not ey) if ee is None else (set(te) == sources and set(ey) == set(cands))
        if set(xx) != set(_pairs(cands)) or set(xy) != expected_xy or set(yy) != set(cands) or not tokens_ok:
            raise PairMismatchError(f"{path}: stored tensors do not match the recorded candidates")
        weight_sum = float(meta["weight_sum"])
        if not math.isfinite(weight_sum):
            raise NonFiniteError(f"{path}: weight_sum is not finite")
        return cls(
            side=meta["side"],
            candidates=cands,
            xx=xx,
            xy=xy,
            yy=yy,
            weight_sum=weight_sum,
            n_tokens=int(meta["n_tokens"]),
            te=te,
            ee=ee,
            ey=ey,
        )
