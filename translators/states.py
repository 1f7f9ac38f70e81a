"""State strategies for the linear-attention layers of a hybrid target (paper 004 §3.5).

A linear-attention layer caches no tokens, only its conv window [1, C, K] and recurrent state [1, Hv, dk, dv]
after the whole prompt, so a token-wise map cannot produce them. Per target linear layer one strategy:

- ``zero``: the layer starts empty (zero window and state); the translated attention layers carry the prompt.
- ``copy``: the assigned source linear layer's final window and state are written as they are; needs the same
  state geometry (Hv, dk, dv, C, K) on both sides.
- ``copy_corrected``: as copy, then a bilinear map per value head, S_t[h] ≈ L[h] S_s[h] R[h] (L: dk x dk,
  R: dv x dv), fitted in closed form by alternating ridge passes on paired source/target states (each pass:
  L with R fixed, then R with L fixed, each a ridge regression shrunk towards the identity, i.e. towards plain
  copy), and an affine map of the conv window applied to each of its K columns, w_t ≈ W w_s + b (ridge towards
  W = I). O(1) in the prompt length.
- ``replay``: the target's own mixer runs over normalised inputs predicted token-wise from the source's per-token
  objects (`translators.replay`); needs no source state. `StateMaps` leaves these layers out of its output and
  `translators.hybrid.HybridTranslator` fills them.

Source linear layers are assigned to target linear layers by relative depth among the linear layers
(`assign_linear_layers`). Statistics are fp64, the fitted maps fp32 (`StateMaps`, an nn.Module so stage 2
can train through them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from translators.errors import ConfigError
from translators.layout import LINEAR, CacheLayout, ConvWindow, RecurrentState

ZERO = "zero"
COPY = "copy"
CORRECTED = "copy_corrected"
REPLAY = "replay"
STRATEGIES = (ZERO, COPY, CORRECTED, REPLAY)
STATE = "recurrent_state"
CONV = "conv_window"


def linear_layers(layout: CacheLayout) -> list[int]:
    """Indices of the layout's linear-attention layers (those holding a recurrent state)."""
    return [layer.index for layer in layout.layers if layer.attention == LINEAR]


def assign_linear_layers(source: CacheLayout, target: CacheLayout) -> dict[int, int]:
    """For each target linear layer, the source linear layer at the nearest relative depth among linear layers.

    The r-th of n_t target linear layers reads the round(r (n_s - 1) / (n_t - 1))-th of the n_s source ones
    (first to first, last to last).

    Raises:
        ConfigError: the source has no linear layer (no state to copy: use ``zero``) or the target has none.
    """
    src, tgt = linear_layers(source), linear_layers(target)
    if not tgt:
        raise ConfigError(f"the target ({target.family}) has no linear-attention layer: there is no state to write")
    if not src:
        raise ConfigError(f"the source ({source.family}) has no linear-attention layer, so there is no state to copy; "
                          f"use the {ZERO!r} strategy")
    if len(tgt) == 1:
        return {tgt[0]: src[len(src) // 2]}
    return {t: src[round(r * (len(src) - 1) / (len(tgt) - 1))] for r, t in enumerate(tgt)}


def check_same_geometry(source: CacheLayout, target: CacheLayout, assignment: Mapping[int, int]) -> None:
    """Raises ConfigError naming the first target layer whose state or window shape differs from its source's
    (copying needs identical geometry; use ``zero`` otherwise)."""
    for t, s in assignment.items():
        for kind in (RecurrentState, ConvWindow):
            want, have = target.layers[t].object_of(kind), source.layers[s].object_of(kind)
            if want.shape != have.shape:
                raise ConfigError(
                    f"target layer {t} holds a {want.kind} of shape {list(want.shape)} but its source layer {s} "
                    f"holds {list(have.shape)}: copying a state needs the same geometry; use the {ZERO!r} strategy")


def same_state_geometry(source: CacheLayout, target: CacheLayout) -> bool:
    """Whether states can be copied: both models have linear layers, and every target linear layer's source layer
    (`assign_linear_layers`) holds a state and window of its shapes."""
    if not linear_layers(source) or not linear_layers(target):
        return False
    try:
        check_same_geometry(source, target, assign_linear_layers(source, target))
    except ConfigError:
        return False
    return True


def check_strategies(strategies: Mapping[int, str], target: CacheLayout) -> None:
    """Raises ConfigError for an unknown strategy or a missing / non-linear target layer."""
    expected = set(linear_layers(target))
    if set(strategies) != expected:
        raise ConfigError(f"a state strategy is needed for each target linear layer {sorted(expected)}, got "
                          f"{sorted(strategies)}")
    for layer, strategy in strategies.items():
        if strategy not in STRATEGIES:
            raise ConfigError(f"layer {layer}: unknown state strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")


# --- Closed-form bilinear correction ------------------------------------------------------------------


def _ridge_towards_identity(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """Per head, M minimising ||Z M - Y||² + λ ||M - I||², from gram = Z^T Z [h, p, p] and cross = Z^T Y
    [h, p, p]; λ = ridge x the head's mean gram diagonal. Returns [h, p, p] fp64."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30).view(-1, 1, 1)
    return torch.linalg.solve(gram + lam * eye, cross + lam * eye)


def fit_bilinear(source: torch.Tensor, target: torch.Tensor, *, ridge: float = 1e-3, passes: int = 2,
                 metric: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value head h, L[h] (dk x dk) and R[h] (dv x dv) with target[n, h] ≈ L[h] source[n, h] R[h].

    Alternating ridge passes starting from R = I: L given R is a ridge regression of target^T rows on
    (source R)^T rows, R given L one of target on L source; both shrink towards the identity (plain copy).

    ``metric`` [Hv, dk, dk] (optional, symmetric PSD) weighs the key side of the error, ||M^½ (L X R − Y)||²:
    the target reads its state only along its queries and keys (`read_metric`), so errors along key directions
    it never reads should not steer R. (L's row-wise fit does not depend on it.)

    Args:
        source, target: [n, Hv, dk, dv] paired states (same prompts).
    Returns:
        (L [Hv, dk, dk], R [Hv, dv, dv]) fp64.
    Raises:
        ConfigError: mismatched shapes, fewer than one pair, or passes < 1.
    """
    if source.shape != target.shape or source.dim() != 4 or source.shape[0] < 1:
        raise ConfigError(f"paired states must both be [n >= 1, Hv, dk, dv], got {list(source.shape)} and "
                          f"{list(target.shape)}")
    if passes < 1:
        raise ConfigError(f"passes must be >= 1, got {passes}")
    x, y = source.double(), target.double()
    heads, dk, dv = x.shape[1:]
    right = torch.eye(dv, dtype=torch.float64).expand(heads, dv, dv)
    for _ in range(passes):
        z = x @ right  # [n, h, dk, dv]; target ≈ L z, i.e. target^T ≈ z^T L^T
        left_t = _ridge_towards_identity(torch.einsum("nhij,nhkj->hik", z, z), torch.einsum("nhij,nhkj->hik", z, y),
                                         ridge)
        left = left_t.transpose(-1, -2)
        w = left @ x  # [n, h, dk, dv]; target ≈ w R
        mw = w if metric is None else metric.double() @ w  # [n, h, dk, dv]
        right = _ridge_towards_identity(torch.einsum("nhji,nhjk->hik", w, mw), torch.einsum("nhji,nhjk->hik", mw, y),
                                        ridge)
    return left, right


def fit_conv_affine(source: torch.Tensor, target: torch.Tensor, *, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """W [C, C] and b [C] with target[n, :, k] ≈ W source[n, :, k] + b for every window column k.

    Ridge towards W = I (plain copy), the bias unpenalised.

    Args:
        source, target: [n, C, K] paired conv windows.
    Returns:
        (W [C, C], b [C]) fp64.
    Raises:
        ConfigError: mismatched shapes.
    """
    if source.shape != target.shape or source.dim() != 3:
        raise ConfigError(f"paired conv windows must both be [n, C, K], got {list(source.shape)} and {list(target.shape)}")
    channels = source.shape[1]
    x = source.double().transpose(1, 2).reshape(-1, channels)  # [n K, C]
    y = target.double().transpose(1, 2).reshape(-1, channels)
    xa = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)  # [n K, C + 1]
    gram, cross = xa.T @ xa, xa.T @ y
    penalty = torch.diag(torch.cat([torch.ones(channels, dtype=x.dtype), torch.zeros(1, dtype=x.dtype)]))
    lam = ridge * gram.diagonal()[:channels].mean().clamp_min(1e-30)
    prior = torch.cat([torch.eye(channels, dtype=x.dtype), torch.zeros(1, channels, dtype=x.dtype)])  # [C + 1, C]
    solution = torch.linalg.solve(gram + lam * penalty, cross + lam * prior)  # [C + 1, C]
    return solution[:channels].T, solution[channels]


def relative_error(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """||predicted - target||² / ||target||² over all entries (fp64)."""
    return float((predicted.double() - target.double()).square().sum() / target.double().square().sum().clamp_min(1e-30))


# --- The state translator ------------------------------------------------------------------------------


class StateMaps(nn.Module):
    """Per target linear layer, a strategy and its source layer; fp32 parameters for ``copy_corrected`` layers.

    Parameters of layer t: ``left_t`` [Hv, dk, dk], ``right_t`` [Hv, dv, dv], ``conv_weight_t`` [C, C],
    ``conv_bias_t`` [C] (identity and zero until fitted, i.e. plain copy).
    """

    def __init__(self, source: CacheLayout, target: CacheLayout, strategies: Mapping[int, str],
                 assignment: Mapping[int, int] | None = None):
        """Raises ConfigError: see `check_strategies`, `assign_linear_layers`, `check_same_geometry`."""
        super().__init__()
        check_strategies(strategies, target)
        self.strategies = dict(strategies)
        copied = {t for t, s in strategies.items() if s in (COPY, CORRECTED)}
        full = assign_linear_layers(source, target) if copied else {}
        if assignment is not None:
            full = {**full, **assignment}
        self.assignment = {t: full[t] for t in sorted(copied)}
        check_same_geometry(source, target, self.assignment)
        self.shapes = {t: (target.layers[t].object_of(RecurrentState).shape, target.layers[t].object_of(ConvWindow).shape)
                       for t in strategies}
        self.maps = nn.ParameterDict()
        for t, strategy in strategies.items():
            if strategy == CORRECTED:
                (heads, dk, dv), (channels, _) = self.shapes[t]
                self.maps[f"left_{t}"] = nn.Parameter(torch.eye(dk).repeat(heads, 1, 1))
                self.maps[f"right_{t}"] = nn.Parameter(torch.eye(dv).repeat(heads, 1, 1))
                self.maps[f"conv_weight_{t}"] = nn.Parameter(torch.eye(channels))
                self.maps[f"conv_bias_{t}"] = nn.Parameter(torch.zeros(channels))

    def set_correction(self, layer: int, left: torch.Tensor, right: torch.Tensor, conv_weight: torch.Tensor,
                       conv_bias: torch.Tensor) -> None:
        """Load a fitted correction (`fit_bilinear`, `fit_conv_affine`) into layer's parameters, as fp32.

        Raises:
            ConfigError: the layer's strategy is not copy_corrected, or a shape differs.
        """
        if self.strategies.get(layer) != CORRECTED:
            raise ConfigError(f"layer {layer} uses {self.strategies.get(layer)!r}, not {CORRECTED!r}")
        for name, value in (("left", left), ("right", right), ("conv_weight", conv_weight), ("conv_bias", conv_bias)):
            param = self.maps[f"{name}_{layer}"]
            if param.shape != value.shape:
                raise ConfigError(f"layer {layer}: {name} must be {list(param.shape)}, got {list(value.shape)}")
            with torch.no_grad():
                param.copy_(value.float())

    def forward(self, states: Mapping[str, Mapping[int, torch.Tensor]]) -> dict[str, dict[int, torch.Tensor]]:
        """Target conv windows and states from the source's.

        Args:
            states: the source's "conv_window" → {layer → [1, C, K]} and "recurrent_state" → {layer → [1, Hv, dk, dv]}
                (a `HybridCapture.states`); only the assigned source layers are read.
        Returns:
            the same structure for every target linear layer but the replayed ones.
        """
        out: dict[str, dict[int, torch.Tensor]] = {CONV: {}, STATE: {}}
        for t, strategy in self.strategies.items():
            if strategy == REPLAY:
                continue  # synthesised from the source's tokens (`translators.replay.ReplayMaps`)
            state_shape, conv_shape = self.shapes[t]
            if strategy == ZERO:  # fp32 like the engine's GDN states; writing casts to the model's dtype
                out[STATE][t] = torch.zeros(1, *state_shape)
                out[CONV][t] = torch.zeros(1, *conv_shape)
                continue
            s = self.assignment[t]
            state, conv = states[STATE][s], states[CONV][s]
            if strategy == CORRECTED:
                left, right = self.maps[f"left_{t}"], self.maps[f"right_{t}"]
                state = left.to(state.dtype) @ state @ right.to(state.dtype)  # [1, Hv, dk, dv]
                weight, bias = self.maps[f"conv_weight_{t}"], self.maps[f"conv_bias_{t}"]
                conv = torch.einsum("cd,bdk->bck", weight.to(conv.dtype), conv) + bias.to(conv.dtype).view(1, -1, 1)
            out[STATE][t], out[CONV][t] = state, conv
        return out


@dataclass(frozen=True)
class CorrectionFit:
    """Held-out relative errors of one target layer's states: plain copy vs the fitted correction."""

    layer: int
    source_layer: int
    state_copy: float
    state_corrected: float
    conv_copy: float
    conv_corrected: float


def fit_corrections(maps: StateMaps, source_states: Sequence[Mapping[str, Mapping[int, torch.Tensor]]],
                    target_states: Sequence[Mapping[str, Mapping[int, torch.Tensor]]], *, ridge: float = 1e-3,
                    passes: int = 2, n_heldout: int = 0,
                    metrics: Mapping[int, torch.Tensor] | None = None) -> list[CorrectionFit]:
    """Fit every ``copy_corrected`` layer of ``maps`` in closed form from paired captures, in place.

    Args:
        source_states, target_states: per prompt, `HybridCapture.states` of the source and of the target on the
            same prompt (one conversation each).
        n_heldout: the last n pairs are left out of the fit and score it (0: score on the fitted pairs).
        metrics: target layer → [Hv, dk, dk] key-side metric of `fit_bilinear` (`read_metric`); default none.
    Returns:
        one CorrectionFit per corrected layer.
    Raises:
        ConfigError: unequal numbers of captures, or too few left to fit.
    """
    if len(source_states) != len(target_states):
        raise ConfigError(f"{len(source_states)} source captures but {len(target_states)} target captures")
    n_fit = len(source_states) - n_heldout
    if n_fit < 1:
        raise ConfigError(f"{len(source_states)} paired captures leave none to fit after holding out {n_heldout}")
    fits = []
    for t, strategy in maps.strategies.items():
        if strategy != CORRECTED:
            continue
        s = maps.assignment[t]
        xs = torch.cat([c[STATE][s] for c in source_states]).double()  # [n, Hv, dk, dv]
        ys = torch.cat([c[STATE][t] for c in target_states]).double()
        xc = torch.cat([c[CONV][s] for c in source_states]).double()  # [n, C, K]
        yc = torch.cat([c[CONV][t] for c in target_states]).double()
        left, right = fit_bilinear(xs[:n_fit], ys[:n_fit], ridge=ridge, passes=passes,
                                   metric=None if metrics is None else metrics[t])
        weight, bias = fit_conv_affine(xc[:n_fit], yc[:n_fit], ridge=ridge)
        maps.set_correction(t, left, right, weight, bias)
        score = slice(n_fit, None) if n_heldout else slice(None)
        fits.append(CorrectionFit(
            layer=t, source_layer=s, state_copy=relative_error(xs[score], ys[score]),
            state_corrected=relative_error(left @ xs[score] @ right, ys[score]),
            conv_copy=relative_error(xc[score], yc[score]),
            conv_corrected=relative_error(torch.einsum("cd,ndk->nck", weight, xc[score]) + bias.view(1, -1, 1),
                                          yc[score])))
    return fits


def read_metric(model: nn.Module, layout: CacheLayout, prompts: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per linear layer, how the model reads its state: M[h] = E[q̂ q̂ᵀ] + E[k̂ k̂ᵀ] over the tokens of ``prompts``
    ([Hv, dk, dk] fp64), with q̂, k̂ the l2-normalised queries and keys of value head h (the output reads S^T q̂,
    the delta-rule update S^T k̂).

    Recomputed from the layer's own projections, causal conv and SiLU over its input (a pre-hook on the mixer).
    """
    import torch.nn.functional as F

    from translators.layout import decoder_of, linear_mixer

    layers = linear_layers(layout)
    mixers = {i: linear_mixer(decoder_of(model).layers[i]) for i in layers}
    inputs: dict[int, torch.Tensor] = {}  # layer → [n_tokens, hidden] mixer input of the current prompt
    sums = {i: 0.0 for i in layers}
    count = 0
    hooks = []
    try:
        for i in layers:
            hooks.append(mixers[i].register_forward_pre_hook(_keep_input(inputs, i), with_kwargs=True))
        with torch.no_grad():
            for ids in prompts:
                model(input_ids=ids.view(1, -1).to(model.device), use_cache=False, logits_to_keep=1)
                for i in layers:
                    mixer = mixers[i]
                    x = _pre_conv(mixer, inputs[i]).T.unsqueeze(0)  # [1, C, n]
                    n = x.shape[-1]
                    conv = F.silu(F.conv1d(x, mixer.conv1d.weight, mixer.conv1d.bias, padding=mixer.conv_kernel_size - 1,
                                           groups=mixer.conv_dim)[..., :n])[0].T  # [n, C]
                    q, k = (F.normalize(part.double(), dim=-1, eps=1e-6) for part in _queries_keys(mixer, conv))
                    sums[i] = sums[i] + torch.einsum("nhi,nhj->hij", q, q) + torch.einsum("nhi,nhj->hij", k, k)
                count += int(ids.numel())
    finally:
        for h in hooks:
            h.remove()
    return {i: sums[i] / max(count, 1) for i in layers}


def _pre_conv(mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[n, hidden] mixer input → [n, C] channels entering the conv: GDN's fused projection, KDA's [q | k | v]."""
    from translators.layout import is_kimi_delta

    if is_kimi_delta(mixer):
        return torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], dim=-1)
    return mixer.in_proj_qkv(x)


def _queries_keys(mixer: nn.Module, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, C] conv output → (queries, keys), each [n, Hv, dk] per value head (GDN repeats its key heads)."""
    from translators.layout import is_kimi_delta

    n = conv.shape[0]
    if is_kimi_delta(mixer):
        width, heads, dim, repeat = mixer.qkv_dim, mixer.num_heads, mixer.head_dim, 1
    else:
        width, heads, dim = mixer.key_dim, mixer.num_k_heads, mixer.head_k_dim
        repeat = mixer.num_v_heads // mixer.num_k_heads
    q = conv[:, :width].reshape(n, heads, dim).repeat_interleave(repeat, dim=1)
    k = conv[:, width:2 * width].reshape(n, heads, dim).repeat_interleave(repeat, dim=1)
    return q, k


def _keep_input(store: dict[int, torch.Tensor], layer: int):
    """A forward pre-hook storing row 0 of a module's `hidden_states` input ([n_tokens, hidden]) under ``layer``."""

    def hook(_module, args, kwargs):
        store[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])[0].detach()

    return hook
