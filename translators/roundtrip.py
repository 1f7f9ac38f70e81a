"""The capture → inject → one-step round trip, checked against a native prefill.

This is the primitive every translator rests on: with an identity "translation", decoding from an injected
cache must reproduce the model's own next-token logits, and gradients must reach every injected layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from translators.capture import capture, capture_hybrid, check_length
from translators.errors import ConfigError
from translators.inject import decode_step, write_cache, write_hybrid_cache
from translators.layout import CacheLayout, is_hybrid
from translators.objects import layer_objects


@dataclass(frozen=True)
class RoundTrip:
    point: str
    max_abs_logit_diff: float  # max |engine − injected| over the vocabulary at the next-token position
    grad_ok: bool  # every injected layer's differentiable cache objects received a finite, non-zero gradient
    layers_without_grad: tuple[int, ...]


def native_next_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [vocab] the model predicts after reading `input_ids` ([n]) in one prefill."""
    return model(input_ids=input_ids.view(1, -1).to(model.device), use_cache=False, logits_to_keep=1).logits[0, -1]


def engine_next_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [vocab] for x_n from the engine's own path: prefill x_{1:n-1} into its cache, decode x_n.

    This is what an injected cache replaces. It equals the one-pass prefill for GQA and MLA; for DeepSeek-V3.2
    (transformers 5.24) the two differ by up to ~0.03 on tiny random models (top-k index selection), so the
    round trip compares against this path.
    """
    ids = input_ids.view(1, -1).to(model.device)
    out = model(input_ids=ids[:, :-1], use_cache=True)
    return model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def roundtrip(model: nn.Module, layout: CacheLayout, input_ids: torch.Tensor, point: str) -> RoundTrip:
    """Capture x_{1:n-1} at `point`, inject it into a fresh cache, decode x_n, compare with the engine's own
    prefill-and-decode (`engine_next_logits`).

    Hybrids (linear-attention layers) capture and inject per layer (`capture_hybrid`, `write_hybrid_cache`): the
    attention layers' K/V at `point`, the linear layers' conv window and recurrent state as the engine holds them;
    gradients must reach every layer's objects, states included.

    Args:
        input_ids: [n] with n ≥ 2.
    Raises:
        ConfigError: fewer than two tokens. PrefixTooLongError: beyond the model's positions.
    """
    check_length(layout, int(input_ids.numel()))
    if input_ids.numel() < 2:
        raise ConfigError("the round trip needs a prompt of at least two tokens")
    ids = input_ids.view(-1)
    with torch.no_grad():
        native = engine_next_logits(model, ids).float()
    if is_hybrid(layout):
        with torch.no_grad():
            cap = capture_hybrid(model, layout, ids[:-1], point)
        tokens = {name: {i: _leaf(x) for i, x in xs.items()} for name, xs in cap.tokens.items()}
        states = {name: {i: _leaf(x) for i, x in xs.items()} for name, xs in cap.states.items()}
        cache = write_hybrid_cache(model, layout, tokens, states, point=point)
        per_layer = [{name: xs[i] for group in (tokens, states) for name, xs in group.items() if i in xs}
                     for i in range(layout.n_layers)]
    else:
        with torch.no_grad():
            cap = capture(model, layout, ids[:-1], point)
        leaves = {name: [_leaf(x) for x in xs] for name, xs in cap.objects.items()}
        cache = write_cache(model, layout, leaves, point=point)
        per_layer = [{name: xs[i] for name, xs in leaves.items()} for i in range(layout.n_layers)]
    logits = decode_step(model, cache, ids[-1:], logits_to_keep=1)[-1].float()
    diff = (logits - native).abs().max().item()
    # A loss that depends on every logit, so each layer's cache objects get a gradient.
    torch.log_softmax(logits, -1).mul(torch.softmax(native, -1)).sum().neg().backward()
    # Objects the forward reads without gradients (the DSA indexer's top-k keys) are checked by the logits only.
    missing = tuple(i for i in range(layout.n_layers)
                    if not all(_has_grad(per_layer[i][obj.name]) for obj in layer_objects(layout, i) if obj.differentiable))
    return RoundTrip(point=point, max_abs_logit_diff=diff, grad_ok=not missing, layers_without_grad=missing)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A detached copy of x that collects a gradient."""
    return x.detach().clone().requires_grad_(True)


def _has_grad(x: torch.Tensor) -> bool:
    """A finite, non-zero gradient reached x."""
    g = x.grad
    return g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)
