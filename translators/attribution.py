"""Where a translator's remaining KL sits: per target layer and cache object, the validation KL when that one
object is the target's own (captured from its prefill) and every other object stays translated.

A substitution that removes most of the KL names the map to improve; one that raises it shows maps that stage 2
tuned together (a translated layer compensating for another). On the embedded GQA → MLA pair the last layer's
rotary key carried about half of the closed form's KL (README, "Where the remaining KL sits").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from translators.capture import capture
from translators.checkpoint_selection import paired_difference
from translators.continuation import cache_logits, kl_per_position, teacher_logits
from translators.cross import (
    CrossSample,
    check_continuation,
    source_capture,
    student_hidden_cross,
    teacher_hidden_cross,
    translated_tensors,
)
from translators.distill import logits_from_hidden
from translators.errors import ConfigError
from translators.inject import write_cache
from translators.stage1 import Side, ValidationKL
from translators.translator import Translator

ALL_OBJECTS = "all"
Objects = dict[str, list[torch.Tensor]]  # object name → per target layer [n_tokens, width]
KLOf = Callable[[Objects], torch.Tensor]  # the target's cache objects → KL per continuation position [m]


@dataclass(frozen=True)
class Substitution:
    """The validation KL with `objects` of target layer `layer` native (the target's own), the rest translated."""

    layer: int
    objects: str  # one object's name, or "all" (every object of the layer)
    kl: ValidationKL
    removed: float  # translated KL − this KL, mean over the samples (> 0: the native object helps)
    removed_se: float  # its paired standard error

    def row(self, translated: float) -> dict[str, float | int | str]:
        """A JSON row; share: the fraction of the translated KL the substitution removes."""
        return {"layer": self.layer, "objects": self.objects, "kl": self.kl.mean, "removed": self.removed,
                "removed_se": self.removed_se, "share": self.removed / translated if translated > 0 else 0.0}


def layer_attribution(source: Side, target: Side, samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      translator: Translator) -> tuple[ValidationKL, list[Substitution]]:
    """The translated validation KL, and one `Substitution` per (target layer, object) and per layer for all of its
    objects at once, over (prefix [n], continuation [m]) samples of a pair that shares a tokenizer.

    Costs (1 + n_layers × (n_objects + 1)) target passes over each continuation.

    Raises:
        ConfigError: fewer than two samples (a paired standard error needs two).
    """

    def scorer(sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[Objects, Objects, KLOf]:
        prefix, continuation = sample
        teacher = teacher_logits(target.model, prefix, continuation)
        cap = capture(source.model, source.layout, prefix[:-1], translator.point)
        native = capture(target.model, target.layout, prefix[:-1], translator.point).objects

        def kl_with(objects: Objects) -> torch.Tensor:
            cache = write_cache(target.model, target.layout, objects, point=translator.point)
            return kl_per_position(teacher, cache_logits(target.model, cache, prefix, continuation))

        return translator.translate_objects(cap.objects, cap.token_ids), native, kl_with

    return _substitutions(samples, translator, scorer)


def cross_layer_attribution(source: Side, target: Side, samples: Sequence[CrossSample],
                            translator: Translator) -> tuple[ValidationKL, list[Substitution]]:
    """`layer_attribution` for a cross-tokenizer pair: the mixed cache of each sample (translated content, the target's
    own boilerplate) with one object at a time the target's own. The target's own object of a translated source token
    is the target's capture at the token's assigned position (App. K's j(i)): in a 1:1 group exactly its object for
    the same text; in a larger group, that of the target token the source token is written at.

    Raises:
        ConfigError: fewer than two samples, or a sample without a continuation.
    """
    def scorer(sample: CrossSample) -> tuple[Objects, Objects, KLOf]:
        check_continuation(sample)
        model = target.model
        teacher = logits_from_hidden(model, teacher_hidden_cross(model, sample))
        own = capture(model, target.layout, sample.target_ids, translator.point).objects
        native = {name: [x[sample.positions] for x in per_layer] for name, per_layer in own.items()}

        def kl_with(objects: Objects) -> torch.Tensor:
            hidden = student_hidden_cross(model, target.layout, sample, objects, translator.point)
            return kl_per_position(teacher, logits_from_hidden(model, hidden))

        return translated_tensors(translator, source_capture(source, sample, translator.point), sample), native, kl_with

    return _substitutions(samples, translator, scorer)



def _substitutions(samples: Sequence, translator: Translator,
                   scorer: Callable[[object], tuple[Objects, Objects, KLOf]]) -> tuple[ValidationKL, list[Substitution]]:
    """The shared loop: `scorer(sample)` gives the translated objects, the target's own objects of the same tokens
    and the KL of a cache built from any mix of the two."""
    if len(samples) < 2:
        raise ConfigError(f"layer attribution needs at least 2 samples, got {len(samples)}")
    groups = [(name,) for name in translator.objects] + ([translator.objects] if len(translator.objects) > 1 else [])
    keys = [(layer, group) for layer in range(translator.n_target_layers) for group in groups]
    base: list[float] = []
    firsts: list[float] = []
    per_key: dict[tuple, tuple[list[float], list[float]]] = {key: ([], []) for key in keys}
    with torch.no_grad():
        for sample in samples:
            translated, native, kl_with = scorer(sample)
            kl = kl_with(translated)
            base.append(kl.mean().item())
            firsts.append(kl[0].item())
            for layer, group in keys:
                mixed = {name: [native[name][i].to(row.dtype) if name in group and i == layer else row
                                for i, row in enumerate(per_layer)]
                         for name, per_layer in translated.items()}
                kl = kl_with(mixed)
                per_key[(layer, group)][0].append(kl.mean().item())
                per_key[(layer, group)][1].append(kl[0].item())
    rows = []
    for (layer, group), (means, first) in per_key.items():
        removed, se = paired_difference(base, means)
        rows.append(Substitution(layer, group[0] if len(group) == 1 else ALL_OBJECTS, ValidationKL.of(means, first),
                                 removed, se))
    return ValidationKL.of(base, firsts), rows
