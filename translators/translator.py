"""The linear cache translator (eq. 3.1): per target layer and cache object, one map over ν source layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from translators.assignment import Assignment
from translators.errors import ConfigError


class Translator(nn.Module):
    """Maps a source capture to the target's cache objects, token-wise.

    For target layer ℓ and object o (GQA: keys K and values V): Ŷℓ_i = T_o[ℓ] · concat_{s ∈ E_o(ℓ)} X_s,i.
    Objects may read different source layers (the R² assignment ranks keys and values separately). Parameters
    are fp32 whatever the models' dtype; the map of object o, layer ℓ is named `o_ℓ` (artifact tensor names).

    Args:
        assignment: {object name: {ℓ: (s, ...)}} covering every target layer, the same layers for every object
            (GQA: {"keys": ..., "values": ...}).
        d_src, d_tgt: flattened widths of the objects (GQA: n_kv_heads * head_dim) of source and target.
        point: capture point the maps act at (keys); values are the same at every point.
    Raises:
        ConfigError: no objects, an object name that cannot name a map, or objects/layers not covered alike.
    """

    def __init__(self, assignment: Mapping[str, Assignment], d_src: int, d_tgt: int, point: str):
        super().__init__()
        # Sorted, so the maps' order (saved tensors, optimizer, gradient clipping) never depends on how the
        # caller happened to build the dict; for GQA this is ("keys", "values").
        _check_objects(tuple(assignment))
        self.objects: tuple[str, ...] = tuple(sorted(assignment))
        self.assignment = {
            name: {int(t): tuple(int(s) for s in src) for t, src in assignment[name].items()} for name in self.objects
        }
        layers = {name: set(a) for name, a in self.assignment.items()}
        if any(cover != layers[self.objects[0]] for cover in layers.values()):
            raise ConfigError(f"{' and '.join(self.objects)} must cover the same target layers")
        self.n_target_layers = len(self.assignment[self.objects[0]])
        if sorted(self.assignment[self.objects[0]]) != list(range(self.n_target_layers)):
            raise ConfigError(f"the assignment must cover target layers 0..{self.n_target_layers - 1}")
        self.d_src, self.d_tgt, self.point = d_src, d_tgt, point
        self.maps = nn.ParameterDict(
            {
                _key(name, t): nn.Parameter(torch.zeros(d_tgt, len(src) * d_src, dtype=torch.float32))
                for name in self.objects
                for t, src in self.assignment[name].items()
            }
        )

    def weight(self, name: str, target_layer: int) -> torch.Tensor:
        """The map of one target layer and object: [d_tgt, ν·d_src]."""
        return self.maps[_key(name, target_layer)]

    def set_weight(self, name: str, target_layer: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.maps[_key(name, target_layer)].copy_(value.to(torch.float32))

    def source_layers(self) -> list[int]:
        """Every source layer some map reads (the rest need not be captured)."""
        return sorted({s for name in self.objects for src in self.assignment[name].values() for s in src})

    def translate_layer(self, name: str, target_layer: int, source: Sequence[torch.Tensor]) -> torch.Tensor:
        """One target layer of object `name` from per-source-layer tensors source[s]: [n_tokens, d_src] →
        [n_tokens, d_tgt]."""
        stacked = torch.cat([source[s] for s in self.assignment[name][target_layer]], dim=-1)  # [n, ν·d_src]
        return stacked.to(torch.float32) @ self.weight(name, target_layer).T

    def translate_objects(self, sources: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Translate a whole source capture: object name → list indexed by source layer of [n_tokens, d_src].

        Objects the translator does not map are ignored.

        Returns:
            {name: list over target layers of [n_tokens, d_tgt] fp32} for every object in `self.objects`.
        Raises:
            ConfigError: an object the translator maps is missing from `sources`.
        """
        missing = [name for name in self.objects if name not in sources]
        if missing:
            raise ConfigError(f"the translator maps {', '.join(missing)} but the source capture holds {', '.join(sources)}")
        return {
            name: [self.translate_layer(name, t, sources[name]) for t in range(self.n_target_layers)]
            for name in self.objects
        }

    def forward(self, *sources: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """Translate one list per object, in `self.objects` order (GQA: `translator(keys, values)`).

        Returns:
            One list over target layers of [n_tokens, d_tgt] fp32 tensors per object, in the same order.
        Raises:
            ConfigError: a number of lists other than the translator's objects.
        """
        if len(sources) != len(self.objects):
            raise ConfigError(f"the translator maps {', '.join(self.objects)}: pass one list per object, got {len(sources)}")
        return tuple(self.translate_objects(dict(zip(self.objects, sources))).values())

    def flops_per_token(self) -> int:
        """Multiply-adds ×2 of all maps for one token (the switch-speed FLOP model)."""
        return sum(2 * p.numel() for p in self.maps.values())


def _check_objects(names: tuple[str, ...]) -> None:
    """Raises ConfigError for no objects or a name that cannot be part of a map name `<name>_<layer>`."""
    if not names:
        raise ConfigError("an assignment needs at least one cache object (e.g. 'keys' and 'values')")
    bad = [name for name in names if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ConfigError(f"cache object names must be identifiers (they name the maps), got {bad}")


def _key(name: str, target_layer: int) -> str:
    return f"{name}_{target_layer}"
