"""DroidSpeak-style partial recompute, the baseline beside the translators (000_… App. M; 004_… §9.4).

At a switch the target recomputes its first `k` decoder layers over the prefix from the tokens (their objects then
equal its own: the first k layers read nothing but the token embeddings and one another) and reuses the source's
objects, through a translator, in the layers above. k = 0 is the translator alone; k = n_layers is a full
re-prefill. The compute it spends is the share of the target's prefill that its first k layers cost; with the
embedding lookup free and the LM head not run on the prefix, that is their share of the decoder's weights
(2 · params FLOPs per token; the attention's n² term is left out, small at these prefix lengths and at most a
layer's share of it).

Pure torch: objects and models in, objects and fractions out.
"""

from __future__ import annotations

import torch
from torch import nn

from translators.capture import HybridCapture
from translators.errors import ConfigError
from translators.layout import decoder_of

Objects = dict[str, dict[int, torch.Tensor]]  # object name → {layer → tensor}


def recomputed_objects(tokens: Objects, states: Objects, native: HybridCapture, k: int, n_layers: int
                       ) -> tuple[Objects, Objects]:
    """The cache objects of a switch that recomputes the first `k` of the target's `n_layers` layers.

    Args:
        tokens, states: translated objects (`HybridTranslator.__call__`): per-token K/V [n, width] of the
            attention layers, conv windows [1, C, K] and recurrent states [1, Hv, dk, dv] of the linear ones.
        native: the target's own capture of the same prefix, at the translator's capture point.
    Returns:
        (tokens, states) with every layer below k taken from `native`, the rest as given.
    Raises:
        ConfigError: k outside [0, n_layers], or a native capture taken at another point or of another length.
    """
    if not 0 <= k <= n_layers:
        raise ConfigError(f"recompute layers must lie in [0, {n_layers}], got {k}")
    lengths = {t.shape[0] for objects in tokens.values() for t in objects.values()}
    if lengths and lengths != {native.n_tokens}:
        raise ConfigError(f"the native capture holds {native.n_tokens} tokens, the translated objects {sorted(lengths)}")
    mixed_tokens = {name: {t: native.tokens[name][t] if t < k else x for t, x in objects.items()}
                    for name, objects in tokens.items()}
    mixed_states = {name: {t: native.states[name][t] if t < k else x for t, x in objects.items()}
                    for name, objects in states.items()}
    return mixed_tokens, mixed_states


def compute_fraction(model: nn.Module, k: int) -> float:
    """The share of the model's prefill compute that its first `k` decoder layers cost (their share of the decoder
    layers' weights, see the module docstring): 0 for k = 0, 1 for every layer.

    Raises:
        ConfigError: k outside [0, n_layers].
    """
    layers = decoder_of(model).layers
    if not 0 <= k <= len(layers):
        raise ConfigError(f"recompute layers must lie in [0, {len(layers)}], got {k}")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return sum(sizes[:k]) / sum(sizes)
