"""The linear KV translator (eq. 3.1): per target layer, one key map and one value map over ν source layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from translators.errors import ConfigError

Assignment = dict[int, tuple[int, ...]]  # target layer -> source layers it reads (ordered as the map's blocks)
SIDES = ("keys", "values")


class Translator(nn.Module):
    """Maps a source capture to target keys/values, token-wise.

    For target layer ℓ: K̂ℓ_i = T_K[ℓ] · concat_{s ∈ E_K(ℓ)} K_s,i and V̂ℓ_i = T_V[ℓ] · concat_{s ∈ E_V(ℓ)} V_s,i.
    Keys and values may read different source layers (the R² assignment ranks them separately).
    Parameters are fp32 whatever the models' dtype.

    Args:
        assignment: {"keys": {ℓ: (s, ...)}, "values": {ℓ: (s, ...)}} covering every target layer.
        d_src, d_tgt: flattened K/V widths (n_kv_heads * head_dim) of source and target.
        point: capture point the maps act at (keys); values are the same at every point.
    """

    def __init__(self, assignment: dict[str, Assignment], d_src: int, d_tgt: int, point: str):
        super().__init__()
        if set(assignment) != set(SIDES):
            raise ConfigError(f"an assignment needs 'keys' and 'values', got {sorted(assignment)}")
        if set(assignment["keys"]) != set(assignment["values"]):
            raise ConfigError("keys and values must cover the same target layers")
        self.assignment = {side: {int(t): tuple(int(s) for s in src) for t, src in assignment[side].items()} for side in SIDES}
        self.n_target_layers = len(self.assignment["keys"])
        if sorted(self.assignment["keys"]) != list(range(self.n_target_layers)):
            raise ConfigError(f"the assignment must cover target layers 0..{self.n_target_layers - 1}")
        self.d_src, self.d_tgt, self.point = d_src, d_tgt, point
        self.maps = nn.ParameterDict(
            {
                _key(side, t): nn.Parameter(torch.zeros(d_tgt, len(src) * d_src, dtype=torch.float32))
                for side in SIDES
                for t, src in self.assignment[side].items()
            }
        )

    def weight(self, side: str, target_layer: int) -> torch.Tensor:
        """The map of one target layer and side: [d_tgt, ν·d_src]."""
        return self.maps[_key(side, target_layer)]

    def set_weight(self, side: str, target_layer: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.maps[_key(side, target_layer)].copy_(value.to(torch.float32))

    def source_layers(self) -> list[int]:
        """Every source layer some map reads (the rest need not be captured)."""
        return sorted({s for side in SIDES for src in self.assignment[side].values() for s in src})

    def translate_layer(self, side: str, target_layer: int, source: Sequence[torch.Tensor]) -> torch.Tensor:
        """One target layer from per-source-layer tensors source[s]: [n_tokens, d_src] → [n_tokens, d_tgt]."""
        stacked = torch.cat([source[s] for s in self.assignment[side][target_layer]], dim=-1)  # [n, ν·d_src]
        return stacked.to(torch.float32) @ self.weight(side, target_layer).T

    def forward(
        self, source_keys: Sequence[torch.Tensor], source_values: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Translate a whole source capture (lists indexed by source layer, each [n_tokens, d_src]).

        Returns:
            (keys, values): lists over target layers of [n_tokens, d_tgt] fp32 tensors.
        """
        keys = [self.translate_layer("keys", t, source_keys) for t in range(self.n_target_layers)]
        values = [self.translate_layer("values", t, source_values) for t in range(self.n_target_layers)]
        return keys, values

    def flops_per_token(self) -> int:
        """Multiply-adds ×2 of all maps for one token (the switch-speed FLOP model)."""
        return sum(2 * p.numel() for p in self.maps.values())


def _key(side: str, target_layer: int) -> str:
    return f"{side}_{target_layer}"
