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


@dataclass
class HybridCapture:
    """Cache objects of one sequence (batch 1) of a hybrid model (layers hold different kinds, `layer_objects`).

    tokens[name][l]: [n_tokens, width] of per-token object `name` (attention "keys"/"values") for each layer l
        that holds it, at capture point `point`.
    states[name][l]: the engine's object after the whole sequence for each linear-attention layer l:
        "recurrent_state" [1, Hv, dk, dv], "conv_window" [1, C, K]. States have no token axis, so they are read
        from the engine cache (what the engine stores) whatever `point` is.
    positions: [n_tokens]. token_ids: [n_tokens].
    """

    point: str
    tokens: dict[str, dict[int, torch.Tensor]]
    states: dict[str, dict[int, torch.Tensor]]
    positions: torch.Tensor
    token_ids: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    def check_finite(self, who: str = "capture") -> None:
        """Raises NonFiniteError naming the shallowest layer whose objects hold NaN/Inf."""
        by_layer = sorted((layer, name, x) for group in (self.tokens, self.states)
                          for name, xs in group.items() for layer, x in xs.items())
        for layer, name, x in by_layer:
            if not torch.isfinite(x).all():
                raise NonFiniteError(f"{who}: NaN/Inf in layer {layer} {name} (capture point {self.point})")


def capture_hybrid(model: nn.Module, layout: CacheLayout, input_ids: torch.Tensor, point: str = "pre_norm") -> HybridCapture:
    """Run a hybrid model once on one conversation and keep every layer's cache objects.

    Attention layers: keys/values from hooks at `point` (as `capture`). Linear-attention layers: the conv window
    and recurrent state the engine holds after the sequence (a state is a function of the whole prefix, so one
    sequence must be one conversation: a second conversation in the same row would start from the first's
    state).

    Args:
        input_ids: [n_tokens] or [1, n_tokens], one conversation.
    Raises:
        ConfigError: batch > 1 (rows of several conversations), empty input, or unknown point.
        PrefixTooLongError: beyond max positions.
    """
    from translators.objects import CacheObject, StateObject, layer_objects

    check_point(point)
    ids = input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ConfigError(f"capture reads one conversation at a time (batch 1), got batch {ids.shape[0]}")
    n = ids.shape[1]
    check_length(layout, n)
    per_layer = [layer_objects(layout, i) for i in range(layout.n_layers)]
    raw: dict[str, dict[int, torch.Tensor]] = {}

    def keep(store: dict[int, torch.Tensor], layer: int):
        def hook(_module, _inputs, output):
            store[layer] = output[0]

        return hook

    with MODEL_STATE_LOCK:
        handles = []
        for i, layer in enumerate(decoder_of(model).layers):
            for obj in per_layer[i]:
                if isinstance(obj, CacheObject):
                    handles.append(obj.module(layer).register_forward_hook(keep(raw.setdefault(obj.name, {}), i)))
        try:
            out = model(input_ids=ids.to(model.device), use_cache=True, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
    positions = torch.arange(n)
    tokens: dict[str, dict[int, torch.Tensor]] = {}
    states: dict[str, dict[int, torch.Tensor]] = {}
    for i, objects in enumerate(per_layer):
        for obj in objects:
            if isinstance(obj, StateObject):
                states.setdefault(obj.name, {})[i] = obj.read(out.cache, i).clone()
            else:
                x = obj.read(layout.layers[i], raw[obj.name][i])
                tokens.setdefault(obj.name, {})[i] = obj.advance(model, layout, i, x, start="pre_norm", end=point,
                                                                  positions=positions)
    return HybridCapture(point=point, tokens=tokens, states=states, positions=positions, token_ids=ids[0].cpu())


def check_unpacked(position_ids: torch.Tensor | None) -> None:
    """Refuse packed rows for a hybrid (a model with linear-attention layers).

    Packing several conversations into one row with restarting positions gives attention a block-diagonal
    mask, but a linear-attention layer's recurrent state runs through the whole row: the second conversation
    silently starts from the first's state. Hybrids read one conversation per row (right-padded).

    Args:
        position_ids: [rows, T] or [T] position ids of the rows about to be read, or None (plain 0..T-1).
    Raises:
        ConfigError: a row's positions restart (do not increase) somewhere, named with the row and token.
    """
    if position_ids is None:
        return
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    restarts = (pos[:, 1:] <= pos[:, :-1]).nonzero()
    if restarts.numel():
        row, token = (int(v) for v in restarts[0])
        raise ConfigError(
            f"row {row} restarts its positions at token {token + 1}: it packs several conversations, and a "
            "linear-attention layer's recurrent state would carry from one conversation into the next (only "
            "attention sees the block-diagonal mask); give a hybrid model one conversation per row (right-padded)")
