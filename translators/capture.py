"""Capture a model's per-layer keys and values at a chosen point, in one forward pass."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from translators.errors import ConfigError, NonFiniteError, PrefixTooLongError
from translators.layout import CacheLayout, decoder_of
from translators.points import check_point, keys_to_point


# Forward hooks and the attention implementation are state on the (shared, frozen) model: a forward run by
# another thread while this capture's hooks are registered would write into this capture, and a capture that
# runs while another thread switched the model to eager attention (App. O weights) reads it with other
# kernels. Whatever registers hooks or changes such state holds this lock, so they run one at a time per
# process (torch already spreads each forward over the cores). Re-entrant: a holder may capture.
MODEL_STATE_LOCK = threading.RLock()


@dataclass
class Capture:
    """Per-layer keys and values of one sequence (batch 1).

    keys[l], values[l]: [n_tokens, n_kv_heads * head_dim] at capture point `point`.
    positions: [n_tokens] the positions the tokens were read at.
    """

    point: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    def check_finite(self, who: str = "capture") -> None:
        """Raises NonFiniteError naming the shallowest layer whose keys or values hold NaN/Inf (where it started)."""
        for layer in range(len(self.keys)):
            for side, t in (("keys", self.keys[layer]), ("values", self.values[layer])):
                if not torch.isfinite(t).all():
                    raise NonFiniteError(f"{who}: NaN/Inf in layer {layer} {side} (capture point {self.point})")


def check_length(layout: CacheLayout, n_tokens: int, what: str = "prompt") -> None:
    """Raises PrefixTooLongError / ConfigError for sequences the model cannot read."""
    if n_tokens < 1:
        raise ConfigError(f"the {what} is empty: at least one token is needed")
    if n_tokens > layout.max_positions:
        raise PrefixTooLongError(
            f"the {what} has {n_tokens} tokens but the model ({layout.family}) reads at most "
            f"{layout.max_positions} positions; shorten it or cap the prefix length"
        )


def capture(model: nn.Module, layout: CacheLayout, input_ids: torch.Tensor, point: str = "pre_norm") -> Capture:
    """Run the model once on `input_ids` and keep its keys at `point` and its values.

    Hooks read the k_proj/v_proj outputs (pre_norm); later points apply the model's own k-norm and RoPE, so
    sliding-window layers are captured at full length even though the engine keeps only the last window.

    Args:
        input_ids: [n_tokens] or [1, n_tokens].
    Raises:
        ConfigError: batch > 1, empty input, or unknown point. PrefixTooLongError: beyond max positions.
    """
    check_point(point)
    ids = input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ConfigError(f"capture reads one sequence at a time (batch 1), got batch {ids.shape[0]}")
    n = ids.shape[1]
    check_length(layout, n)
    raw_keys: dict[int, torch.Tensor] = {}
    raw_values: dict[int, torch.Tensor] = {}

    def keep(store: dict[int, torch.Tensor], layer: int):
        def hook(_module, _inputs, output):
            store[layer] = output[0]  # [n_tokens, n_kv_heads * head_dim]

        return hook

    with MODEL_STATE_LOCK:
        handles = []
        for i, layer in enumerate(decoder_of(model).layers):
            handles.append(layer.self_attn.k_proj.register_forward_hook(keep(raw_keys, i)))
            handles.append(layer.self_attn.v_proj.register_forward_hook(keep(raw_values, i)))
        try:
            # logits_to_keep=1: only the hidden states matter here; full logits of a 262k vocabulary are costly.
            model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
    positions = torch.arange(n)
    keys = [
        keys_to_point(model, layout, i, raw_keys[i], start="pre_norm", end=point, positions=positions)
        for i in range(layout.n_layers)
    ]
    values = [raw_values[i] for i in range(layout.n_layers)]
    return Capture(point=point, keys=keys, values=values, positions=positions)
