"""The replay state strategy (paper 004 §3.5): synthesise a linear layer's state by running the target's own mixer.

A token-wise map predicts, for every prompt token, the target linear layer's normalised input (the output of its
``input_layernorm``, [n_tokens, hidden]) from the source's per-token cache objects; the target's own input
projections, causal conv and gated delta-rule recurrence then run over the predicted inputs, and the conv
window and final recurrent state they leave are what the layer caches. Unlike ``copy`` this needs no linear layer
in the source (GQA → hybrid) and no shared state geometry; its cost grows linearly with the prompt (one mixer pass
per replayed layer, no MLPs, no attention), where copy is O(1).

Map of target layer t: ``weight_t`` [hidden_t, d_in + 1], affine (a ones column: the normalised inputs are not
centred), reading the concatenated per-token objects (``keys`` | ``values``, or an MLA source's latent | rotary
key) of the ``nu`` source layers holding per-token objects nearest to t's relative depth. Fitted in closed form
(ridge on fp64 Gram statistics, `fit_replay`), fp32 afterwards; stage 2 trains through the replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from translators.errors import ConfigError, UnsupportedModelError
from translators.layout import LINEAR, CacheLayout, decoder_of, linear_mixer
from translators.solve import ridge_solve
from translators.states import CONV, STATE


def token_layers(layout: CacheLayout) -> list[int]:
    """Indices of the layout's layers holding per-token objects (every layer but the linear-attention ones)."""
    return [layer.index for layer in layout.layers if layer.attention != LINEAR]


def replay_sources(source: CacheLayout, target: CacheLayout, layers: Sequence[int], nu: int) -> dict[int, list[int]]:
    """For each replayed target layer, the ``nu`` consecutive source token layers nearest its relative depth.

    Relative depth over each model's whole stack: target layer t sits at t / (n_t - 1); the source token layer
    closest to that depth starts the window, which is shifted down where it would run past the last one.

    Raises:
        ConfigError: nu < 1, or the source has fewer than nu token layers.
    """
    candidates = token_layers(source)
    if nu < 1 or nu > len(candidates):
        raise ConfigError(f"replay reads nu source layers holding per-token objects; the source has "
                          f"{len(candidates)} ({candidates}), got nu={nu}")
    depth = {s: s / max(source.n_layers - 1, 1) for s in candidates}
    out = {}
    for t in layers:
        at = t / max(target.n_layers - 1, 1)
        nearest = min(range(len(candidates)), key=lambda r: (abs(depth[candidates[r]] - at), r))
        start = min(nearest, len(candidates) - nu)
        out[t] = candidates[start:start + nu]
    return out


def _mixer(model: nn.Module, layer: int) -> nn.Module:
    """Layer ``layer``'s linear-attention mixer (`translators.layout.linear_mixer`).

    Raises:
        UnsupportedModelError: the layer has none.
    """
    mixer = linear_mixer(decoder_of(model).layers[layer])
    if mixer is None:
        raise UnsupportedModelError(f"layer {layer} of {type(model).__name__} has no linear-attention mixer to replay "
                                    f"(replay supports Gated DeltaNet and Kimi Delta Attention layers)")
    return mixer


def mixer_inputs(model: nn.Module, layers: Sequence[int], input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The normalised input each of ``layers``' linear mixers reads, {layer: [n_tokens, hidden]}, from one native
    forward over ``input_ids`` ([n] or [1, n], one conversation), without gradients."""
    store: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(_module, args, kwargs):
            store[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])[0].detach()

        return hook

    handles = [_mixer(model, t).register_forward_pre_hook(keep(t), with_kwargs=True) for t in layers]
    try:
        with torch.no_grad():
            model(input_ids=input_ids.view(1, -1).to(model.device), use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return store


def replay_mixer(model: nn.Module, layer: int, inputs: torch.Tensor, cache: DynamicCache | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run target ``layer``'s own mixer over ``inputs`` [n_tokens, hidden] on ``cache`` (continuing from the conv
    window and state it holds for that layer, updated in place), or from an empty cache when None.

    Returns:
        (conv window [1, C, K], recurrent state [1, Hv, dk, dv]) it leaves; differentiable in ``inputs``.
    """
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=model.config) if cache is None else cache
    _mixer(model, layer)(hidden_states=inputs.to(dtype).unsqueeze(0), cache=cache)
    return cache.get_conv_state(layer), cache.get_recurrent_state(layer)


class ReplayMaps(nn.Module):
    """The replay maps of a hybrid target's replayed linear layers.

    ``weight_<t>`` [hidden_t, d_in + extra_width + 1] fp32, zero until `fit_replay`; ``sources[t]``: the source
    layers it reads; ``extra_width``: columns appended per token after the source objects (token identity's
    target embedding), 0 without.
    """

    def __init__(self, source: CacheLayout, target: CacheLayout, layers: Sequence[int], hidden: int, nu: int = 2,
                 extra_width: int = 0):
        """Args:
            layers: the target linear layers to replay.
            hidden: the target's residual-stream width (its mixers' input width, ``config.hidden_size``).
            extra_width: see the class docstring.
        Raises:
            ConfigError: a layer that is not linear in the target; see `replay_sources`.
        """
        super().__init__()
        linear = {layer.index for layer in target.layers if layer.attention == LINEAR}
        if not set(layers) <= linear:
            raise ConfigError(f"replay synthesises linear-attention layers {sorted(linear)}; got {sorted(layers)}")
        from translators.objects import CacheObject, layer_objects

        self.sources = replay_sources(source, target, sorted(layers), nu)
        widths = {s: sum(obj.width(source.layers[s]) for obj in layer_objects(source, s) if isinstance(obj, CacheObject))
                  for s in token_layers(source)}  # the per-token objects of each source layer, concatenated
        self.weights = nn.ParameterDict({
            str(t): nn.Parameter(torch.zeros(hidden, sum(widths[s] for s in srcs) + extra_width + 1))
            for t, srcs in self.sources.items()})

    def features(self, tokens: Mapping[str, Mapping[int, torch.Tensor]], layer: int,
                 extra: torch.Tensor | None = None) -> torch.Tensor:
        """[n_tokens, d_in + extra_width + 1]: the source objects target ``layer`` reads, concatenated, then
        ``extra`` ([n_tokens, extra_width], e.g. token embeddings) and a ones column."""
        parts = [xs[s] for s in self.sources[layer] for xs in tokens.values() if s in xs]
        if extra is not None:
            parts.append(extra.to(parts[0].dtype))
        x = torch.cat(parts, dim=-1)
        return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=-1)

    def inputs(self, tokens: Mapping[str, Mapping[int, torch.Tensor]], extra: torch.Tensor | None = None
               ) -> dict[int, torch.Tensor]:
        """Predicted normalised mixer inputs {layer: [n_tokens, hidden]} from the source's per-token objects."""
        return {t: (lambda x: x @ self.weights[str(t)].T.to(x.dtype))(self.features(tokens, t, extra))
                for t in self.sources}

    def forward(self, tokens: Mapping[str, Mapping[int, torch.Tensor]], target_model: nn.Module,
                extra: torch.Tensor | None = None) -> dict[str, dict[int, torch.Tensor]]:
        """The replayed layers' conv windows [1, C, K] and states [1, Hv, dk, dv], {kind: {layer: tensor}}."""
        out: dict[str, dict[int, torch.Tensor]] = {CONV: {}, STATE: {}}
        for t, u in self.inputs(tokens, extra).items():
            out[CONV][t], out[STATE][t] = replay_mixer(target_model, t, u)
        return out


@dataclass(frozen=True)
class ReplayFit:
    """Held-out R² of one replayed layer's predicted mixer inputs."""

    layer: int
    source_layers: tuple[int, ...]
    r2: float


def fit_replay(maps: ReplayMaps, source_tokens: Sequence[Mapping[str, Mapping[int, torch.Tensor]]],
               target_inputs: Sequence[Mapping[int, torch.Tensor]], *, ridge: float = 1e-4,
               n_heldout: int = 0, extras: Sequence[torch.Tensor | None] | None = None) -> list[ReplayFit]:
    """Fit every replay map in closed form (ridge on fp64 Gram statistics), in place.

    Args:
        source_tokens: per conversation, the source capture's per-token objects (`HybridCapture.tokens`).
        target_inputs: per conversation, the target's native `mixer_inputs` over the same tokens.
        extras: per conversation, the columns appended after the source objects ([n_tokens, extra_width]: token
            embeddings), or None without.
        n_heldout: the last n conversations score the fit (R²) instead of entering it; 0 scores on the fitted ones.
    Raises:
        ConfigError: unequal counts, token counts that differ within a pair, or none left to fit.
    """
    if len(source_tokens) != len(target_inputs):
        raise ConfigError(f"{len(source_tokens)} source captures but {len(target_inputs)} target input captures")
    n_fit = len(source_tokens) - n_heldout
    if n_fit < 1:
        raise ConfigError(f"{len(source_tokens)} paired captures leave none to fit after holding out {n_heldout}")
    fits = []
    for t, srcs in maps.sources.items():
        appended = extras if extras is not None else [None] * len(source_tokens)
        x = [maps.features(tokens, t, e).double() for tokens, e in zip(source_tokens, appended)]  # [n_tokens, d_in + 1]
        y = [inputs[t].double() for inputs in target_inputs]  # each [n_tokens, hidden]
        for i, (a, b) in enumerate(zip(x, y)):
            if len(a) != len(b):
                raise ConfigError(f"pair {i}: {len(a)} source tokens but {len(b)} target tokens; capture both "
                                  f"models on the same conversation")
        gram = sum(a.T @ a for a in x[:n_fit])
        cross = sum(a.T @ b for a, b in zip(x[:n_fit], y[:n_fit]))
        weights = ridge_solve(gram, cross, ridge)  # [d_in + 1, hidden]
        with torch.no_grad():
            maps.weights[str(t)].copy_(weights.T.float())
        scored = slice(n_fit, None) if n_heldout else slice(None)
        xs, ys = torch.cat(x[scored]), torch.cat(y[scored])
        r2 = 1.0 - float((xs @ weights - ys).square().sum() / (ys - ys.mean(0)).square().sum().clamp_min(1e-30))
        fits.append(ReplayFit(layer=t, source_layers=tuple(srcs), r2=r2))
    return fits
