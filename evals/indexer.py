"""Sparse-attention indexer agreement: which positions a DSA target's lightning indexer selects when its
indexer keys are translated, against what its own keys select (hybrid paper §6.2; issue acceptance: ≥ 90%).

The rest of the target's cache (MLA latent, rotary key) is its own, so the measurement isolates the indexer keys:
the same queries score the same positions, only the keys they are scored against differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from translators.capture import MODEL_STATE_LOCK
from translators.inject import write_cache
from translators.layout import CacheLayout, IndexerKeys, decoder_of
from translators.objects import INDEXER_KEYS


def has_indexer(layout: CacheLayout) -> bool:
    """Whether every layer holds indexer keys (a DSA model)."""
    return all(any(isinstance(obj, IndexerKeys) for obj in layer.objects) for layer in layout.layers)


def indexer_selections(model: nn.Module, layout: CacheLayout, objects: Mapping[str, Sequence[torch.Tensor]],
                       point: str, ids: torch.Tensor) -> list[torch.Tensor]:
    """The top-k positions each layer's indexer selects for every query of `ids` ([m] tokens read after the
    cached prefix of `objects`, at `point`): per layer [m, k] int64 (sorted per query)."""
    selected: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(_module, _args, output):
            selected[layer] = output[0].long().sort(-1).values.cpu()  # [m, k]
        return hook

    with MODEL_STATE_LOCK, torch.no_grad():
        handles = [layer.self_attn.indexer.register_forward_hook(keep(i))
                   for i, layer in enumerate(decoder_of(model).layers)]
        try:
            cache = write_cache(model, layout, objects, point=point)
            model(input_ids=ids.view(1, -1).to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
    return [selected[i] for i in range(layout.n_layers)]


def topk_overlap(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor], n_cached: int) -> float:
    """Mean over layers and queries of |other ∩ reference| / |reference|, counting cached positions only
    (< n_cached): the query tokens' own positions are selected from their own keys in both runs."""
    shares = []
    for ref, oth in zip(reference, other, strict=True):
        for r, o in zip(ref, oth, strict=True):
            r_set = {int(p) for p in r if p < n_cached}
            if r_set:
                shares.append(len(r_set & {int(p) for p in o}) / len(r_set))
    return sum(shares) / len(shares) if shares else float("nan")


def translated_indexer_overlap(model: nn.Module, layout: CacheLayout, native: Mapping[str, Sequence[torch.Tensor]],
                               translated: Mapping[str, Sequence[torch.Tensor]], point: str,
                               ids: torch.Tensor) -> float:
    """Top-k agreement of the target's indexer reading `translated` indexer keys instead of its `native` ones
    (both: object name → per layer [n_cached, width] at `point`; every other object stays native)."""
    mixed = {**native, INDEXER_KEYS.name: translated[INDEXER_KEYS.name]}
    n_cached = native[INDEXER_KEYS.name][0].shape[0]
    return topk_overlap(indexer_selections(model, layout, native, point, ids),
                        indexer_selections(model, layout, mixed, point, ids), n_cached)
