"""Capture a model's per-layer cache objects (keys and values for GQA) at a chosen point, in one forward pass."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from translators.errors import ConfigError, NonFiniteError, PrefixTooLongError
from translators.layout import CacheLayout, decoder_of
from translators.objects import CacheObject, cache_objects
from translators.points import check_point


# Forward hooks and the attention implementation are state on the (shared, frozen) model: a forward run by
# another thread while this capture's hooks are registered would write into this capture, and a capture that
# runs while another thread switched the model to eager attention (App. O weights) reads it with other
# kernels. Whatever registers hooks or changes such state holds this lock, so they run one at a time per
# process (torch already spreads each forward over the cores). Re-entrant: a holder may capture.
MODEL_STATE_LOCK = threading.RLock()


@dataclass
class Capture:
    """Per-layer cache objects of one sequence (batch 1).

    objects[name][l]: [n_tokens, width] of object `name` (e.g. "keys", "values") in layer l, at capture point
    `point`. positions: [n_tokens] the positions the tokens were read at. token_ids: [n_tokens] the ids read.
    """

    point: str
    objects: dict[str, list[torch.Tensor]]
    positions: torch.Tensor
    token_ids: torch.Tensor | None = None  # [n_tokens] the ids read (token identity's `ids` variant needs them)

    @property
    def keys(self) -> list[torch.Tensor]:
        """GQA keys per layer (objects["keys"])."""
        return self.objects["keys"]

    @property
    def values(self) -> list[torch.Tensor]:
        """GQA values per layer (objects["values"])."""
        return self.objects["values"]

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    def check_finite(self, who: str = "capture") -> None:
        """Raises NonFiniteError naming the shallowest layer whose objects hold NaN/Inf (where it started)."""
        n_layers = len(next(iter(self.objects.values())))
        for layer in range(n_layers):
            for name, tensors in self.objects.items():
                if not torch.isfinite(tensors[layer]).all():
                    raise NonFiniteError(f"{who}: NaN/Inf in layer {layer} {name} (capture point {self.point})")


def check_length(layout: CacheLayout, n_tokens: int, what: str = "prompt") -> None:
    """Raises PrefixTooLongError / ConfigError for sequences the model cannot read."""
    if n_tokens < 1:
        raise ConfigError(f"the {what} is empty: at least one token is needed")
    if n_tokens > layout.max_positions:
        raise PrefixTooLongError(
            f"the {what} has {n_tokens} tokens but the model ({layout.family}) reads at most "
            f"{layout.max_positions} positions; shorten it or cap the prefix length"
        )


def capture(
    model: nn.Module,
    layout: CacheLayout,
    input_ids: torch.Tensor,
    point: str = "pre_norm",
    objects: tuple[CacheObject, ...] | None = None,
) -> Capture:
    """Run the model once on `input_ids` and keep each cache object at `point`.

    Hooks read each object's module output (GQA: k_proj/v_proj, i.e. pre_norm); later points apply the model's
    own k-norm and RoPE, so sliding-window layers are captured at full length even though the engine keeps only
    the last window.

    Args:
        input_ids: [n_tokens] or [1, n_tokens].
        objects: the objects to capture; default `cache_objects(layout)`.
    Raises:
        ConfigError: batch > 1, empty input, or unknown point. PrefixTooLongError: beyond max positions.
    """
    check_point(point)
    objects = cache_objects(layout) if objects is None else objects
    ids = input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ConfigError(f"capture reads one sequence at a time (batch 1), got batch {ids.shape[0]}")
    n = ids.shape[1]
    check_length(layout, n)
    raw: dict[str, dict[int, torch.Tensor]] = {obj.name: {} for obj in objects}

    def keep(store: dict[int, torch.Tensor], layer: int):
        def hook(_module, _inputs, output):
            store[layer] = output[0]  # [n_tokens, module width]; obj.read selects the object's columns

        return hook

    with MODEL_STATE_LOCK:
        handles = []
        for i, layer in enumerate(decoder_of(model).layers):
            for obj in objects:
                handles.append(obj.module(layer).register_forward_hook(keep(raw[obj.name], i)))
        try:
            # logits_to_keep=1: only the hidden states matter here; full logits of a 262k vocabulary are costly.
            model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
    positions = torch.arange(n)
    captured = {
        obj.name: [
            obj.advance(model, layout, i, obj.read(layout.layers[i], raw[obj.name][i]), start="pre_norm", end=point,
                        positions=positions)
            for i in range(layout.n_layers)
        ]
        for obj in objects
    }
    return Capture(point=point, objects=captured, positions=positions, token_ids=ids[0].cpu())
