"""Cross-tokenizer samples and the target cache they translate into (KV-Lingo App. K, Fig. 26).

When the two models tokenize differently, a sample holds each model's own rendering of the prefix. The content
(the messages' text) is aligned group by group (`translators.alignment`): every content token of the source is
translated and its key rotated at the position of the target token it is assigned to; the target's boilerplate
(BOS, turn delimiters, headers, a system prompt only one template injects) has no counterpart, so the target
prefills it itself on top of what is already cached. The target cache of a prefix therefore interleaves
translated runs and the target's own prefill, in target order:

    [prefill: <bos> "User" ":"] [translated: Hello there] [prefill: "\\n" "Assistant"]   then decode ":" y_1..

The last target prefix token is always decoded with the continuation, as in the same-tokenizer geometry
(`translators.continuation`), so the quantity trained is the quantity evaluated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from translators.capture import Capture, capture
from translators.continuation import kl_per_position
from translators.distill import Objective, continuation_loss, logits_from_hidden
from translators.errors import ConfigError
from translators.generation import Decoded, GenerationSettings, decode_from
from translators.gram import GramStats
from translators.layout import CacheLayout, decoder_of
from translators.objects import CacheObject, cache_objects, engine_tensor, fill_cache_layer, object_inputs, same_kinds
from translators.stage1 import (
    WEIGHTINGS, ReferenceMemo, Side, ValidationKL, accumulate_pair, attention_weights, validation_kl,
)
from translators.translator import Translator, source_features

PREFILL = "prefill"
TRANSLATED = "translated"


@dataclass(frozen=True, eq=False)
class CrossSample:
    """One (prefix, continuation) sample of a cross-tokenizer pair.

    Attributes:
        source_ids: [p] int64, the source's rendering of the prefix.
        target_ids: [q] int64, the target's rendering of the prefix; its last token is boilerplate (the header
            the answer follows) and is decoded together with the continuation.
        continuation_ids: [m] int64, the answer in target tokens (empty for a prompt that is only decoded from).
        translated: [k] int64, increasing indices into source_ids of the content tokens that are translated.
        positions: [k] int64, non-decreasing: the target position each translated token's key is rotated at
            (its assigned target token, App. K).
        source_group: [k] int64, the alignment group of each translated token.
        target_group: [q] int64, the alignment group of each target token; -1 for boilerplate (prefilled).
        conversation: index of the conversation it was cut from (for splitting).
    """

    source_ids: torch.Tensor
    target_ids: torch.Tensor
    continuation_ids: torch.Tensor
    translated: torch.Tensor
    positions: torch.Tensor
    source_group: torch.Tensor
    target_group: torch.Tensor
    conversation: int

    def __post_init__(self) -> None:
        q, k = self.target_ids.numel(), self.translated.numel()
        if q < 2:
            raise ConfigError("a cross-tokenizer sample needs ≥ 2 target prefix tokens (one cached, one decoded)")
        if self.target_group.shape != (q,) or any(t.shape != (k,) for t in (self.positions, self.source_group)):
            raise ConfigError("translated, positions and source_group must have one entry per translated token, "
                              "target_group one per target prefix token")
        if int(self.target_group[-1]) != -1:
            raise ConfigError("the last target prefix token must be boilerplate (it is decoded with the continuation)")
        if k and (int(self.positions.max()) >= q - 1 or int(self.positions.min()) < 0):
            raise ConfigError("translated positions must lie inside the cached target prefix [0, q-1)")

    def fingerprint_bytes(self) -> bytes:
        """Both renderings, the continuation and the alignment as bytes, for content hashes of the data."""
        parts = (self.source_ids, self.target_ids, self.continuation_ids, self.translated, self.positions,
                 self.source_group, self.target_group)
        return b"|".join(t.numpy().tobytes() for t in parts)

    @property
    def n_prefilled(self) -> int:
        """Target prefix tokens the target computes itself (boilerplate, the decoded last token included)."""
        return int((self.target_group < 0).sum())

    def segments(self) -> list[tuple[str, int, int]]:
        """The target cache of target_ids[:-1] as runs in target order: (PREFILL, lo, hi) prefills
        target_ids[lo:hi] at positions lo..hi-1; (TRANSLATED, lo, hi) writes translated tokens lo..hi-1 (indices
        into `translated`) at their `positions`. Groups are contiguous and in the same order on both sides, so a
        run of content target tokens owns a contiguous block of translated tokens."""
        groups = self.target_group[:-1].tolist()
        source_group = self.source_group.tolist()
        runs: list[tuple[str, int, int]] = []
        cursor = 0  # next translated token
        start = 0
        while start < len(groups):
            content = groups[start] >= 0
            end = start
            while end < len(groups) and (groups[end] >= 0) == content:
                end += 1
            if content:
                last_group = groups[end - 1]
                stop = cursor
                while stop < len(source_group) and source_group[stop] <= last_group:
                    stop += 1
                if stop > cursor:
                    runs.append((TRANSLATED, cursor, stop))
                cursor = stop
            else:
                runs.append((PREFILL, start, end))
            start = end
        return runs


def check_continuation(sample: CrossSample) -> None:
    if sample.continuation_ids.numel() < 1:
        raise ConfigError("zero-length continuation: every training or validation sample needs ≥ 1 continuation token")


def group_mean_targets(rows: torch.Tensor, target_group: torch.Tensor, source_group: torch.Tensor) -> torch.Tensor:
    """Stage-1 regression targets: for each translated source token, the mean of its group's target rows.

    Args:
        rows: [q, d] target rows (one per target prefix token).
        target_group: [q] group per target token, -1 for boilerplate.
        source_group: [k] group per translated source token.
    Returns:
        [k, d] in the dtype of `rows`.
    """
    content = target_group >= 0
    n_groups = int(target_group.max()) + 1 if bool(content.any()) else 0
    sums = rows.new_zeros((n_groups, rows.shape[1])).index_add_(0, target_group[content], rows[content])
    counts = torch.bincount(target_group[content], minlength=n_groups).to(rows.dtype).clamp_min(1)
    return (sums / counts[:, None])[source_group]


def group_attention_weights(per_target: torch.Tensor, target_group: torch.Tensor, source_group: torch.Tensor
                            ) -> torch.Tensor:
    """App. O's weights for the regression rows of a cross-tokenizer sample.

    A group of p source and q target tokens is one stretch of text; its p rows all regress onto the group's mean
    target row, so together they stand for its q target tokens and carry the attention mass those receive, split
    evenly between them. In a 1:1 group a row's weight is its target token's own ā_j; summed over the rows, the
    weights are the mass on the content tokens (boilerplate is prefilled by the target, so it has no row).

    Args:
        per_target: [q] ā_j of the target prefix tokens (`translators.stage1.attention_weights`).
        target_group: [q] group per target token, -1 for boilerplate.
        source_group: [k] group per translated source token.
    Returns:
        [k] non-negative weights, in the dtype of `per_target`.
    """
    content = target_group >= 0
    n_groups = int(target_group.max()) + 1 if bool(content.any()) else 0
    mass = per_target.new_zeros(n_groups).index_add_(0, target_group[content], per_target[content])
    rows = torch.bincount(source_group, minlength=n_groups).to(per_target.dtype).clamp_min(1)
    return (mass / rows)[source_group]


def cross_attention_weights(target: Side, sample: CrossSample) -> torch.Tensor:
    """[k] App. O's weight of each translated source token: the attention the target's continuation queries pay to
    its group's target tokens when the target reads its own rendering (`group_attention_weights`).

    Raises:
        ConfigError: a zero-length continuation (no queries to weight by).
    """
    check_continuation(sample)
    return group_attention_weights(attention_weights(target, sample.target_ids, sample.continuation_ids),
                                   sample.target_group, sample.source_group)


CROSS_CODEBOOK_ERROR = ("token identity 'codebook' decodes the source's own token ids, which do not index the "
                        "target's embedding across tokenizers: use --token-identity ids (the target's ids of the "
                        "aligned tokens) or none")


def aligned_token_ids(sample: CrossSample) -> torch.Tensor:
    """[k] the target's token id at the position each translated source token is assigned to (App. K's j(i)).

    These are token identity's ids across tokenizers: the text is known on both sides, so the translator may
    read the target's own embedding of the target token its row stands for (exactly the token of the same text
    in a 1:1 group, e.g. a digit).
    """
    return sample.target_ids[sample.positions]


def accumulate_cross(
    stats: dict[str, GramStats],
    source: Side,
    target: Side,
    samples: Sequence[CrossSample],
    point: str,
    objects: tuple[CacheObject, ...] | None = None,
    on_sample: Callable[[int], None] | None = None,
    token_identity=None,
    weighting: str = "uniform",
) -> dict[str, GramStats]:
    """Add paired statistics of each sample's aligned tokens to `stats` (in place): the source's capture of each
    translated token against the mean of its group's target captures (App. K, "Initialising the translators").

    token_identity: a `translators.token_identity.TokenIdentity` of the `ids` variant: the target's embedding of
        each translated token's aligned target id (`aligned_token_ids`) is appended, as the translator will.
    weighting: "uniform" (every translated token counts once) or "attention" (App. O: each row weighted by the
        attention its group receives from the target's continuation queries, `cross_attention_weights`).

    Raises:
        ConfigError: unknown weighting; the attention weighting on a sample without a continuation.
        NonFiniteError: a capture holds NaN/Inf.
    """
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"unknown weighting {weighting!r}; choose from {', '.join(WEIGHTINGS)}")
    objects = cache_objects(target.layout) if objects is None else objects
    inputs = object_inputs(source.layout, target.layout, tuple(obj.name for obj in objects))
    source_objects = objects if same_kinds(source.layout, target.layout) else None  # None: the source's own
    with torch.no_grad():
        for sample in samples:
            if sample.translated.numel() == 0:  # nothing to regress (cross_sample never builds these)
                continue
            src = capture(source.model, source.layout, sample.source_ids, point, source_objects)
            tgt = capture(target.model, target.layout, sample.target_ids, point, objects)
            src.check_finite("source")
            tgt.check_finite("target")
            tokens = token_identity.embed(aligned_token_ids(sample)) if token_identity is not None else None
            weights = cross_attention_weights(target, sample) if weighting == "attention" else None
            for obj in objects:
                xs = [source_features(src.objects, inputs[obj.name], s)[sample.translated]
                      for s in range(source.layout.n_layers)]
                ys = [group_mean_targets(y, sample.target_group, sample.source_group) for y in tgt.objects[obj.name]]
                stats[obj.name].accumulate(xs, ys, weights, tokens)
            if on_sample:
                on_sample(sample.target_ids.numel())
    return stats


def mixed_cache(
    model: nn.Module,
    layout: CacheLayout,
    sample: CrossSample,
    tensors: Mapping[str, Sequence[torch.Tensor]] | None,
    point: str,
) -> DynamicCache:
    """The target's cache of target_ids[:-1]: translated runs written at their assigned positions, boilerplate
    prefilled by the target itself on top of what precedes it. Differentiable in `tensors` (the prefills attend
    to translated content, so gradients reach it through them too).

    Args:
        tensors: cache object name → per target layer [k, width] translated tensors at `point`, in
            `cache_objects(layout)` order; None writes nothing (the `empty_prefix`-style control keeps only the
            boilerplate).
    """
    cache = DynamicCache(config=model.config)
    for kind, lo, hi in sample.segments():
        if kind == PREFILL:
            prefill_run(model, cache, sample.target_ids[lo:hi], lo)
        elif tensors is not None:
            write_run(model, layout, cache, {name: [x[lo:hi] for x in xs] for name, xs in tensors.items()},
                      sample.positions[lo:hi], point)
    return cache


def prefill_run(model: nn.Module, cache: DynamicCache, ids: torch.Tensor, start: int) -> None:
    """The model reads ids ([n] int64) at positions start..start+n-1 on top of `cache` (extended in place): a
    boilerplate run of a mixed cache. Positions are explicit because a mixed cache holds fewer or more entries
    than the positions it spans."""
    positions = torch.arange(start, start + ids.numel(), device=model.device).view(1, -1)
    decoder_of(model)(input_ids=ids.view(1, -1).to(model.device), cache=cache, use_cache=True, position_ids=positions)


def write_run(
    model: nn.Module, layout: CacheLayout, cache: DynamicCache, tensors: Mapping[str, Sequence[torch.Tensor]],
    positions: torch.Tensor, point: str,
) -> None:
    """Append translated cache objects to `cache` (in place): the model's own k-norm and RoPE applied at `positions`.

    Args:
        tensors: cache object name → per layer [k, width] at `point` (every object of `cache_objects(layout)`).
        positions: [k] the target position of each entry (repeats and gaps allowed: App. K's assignment).
    """
    objects = cache_objects(layout)
    dtype = next(model.parameters()).dtype
    for i in range(layout.n_layers):
        engine = [engine_tensor(obj, model, layout, i, tensors[obj.name][i].to(dtype), point=point, positions=positions)
                  for obj in objects]
        fill_cache_layer(cache, i, objects, engine)


def student_hidden_cross(
    model: nn.Module, layout: CacheLayout, sample: CrossSample, tensors: Mapping[str, Sequence[torch.Tensor]] | None,
    point: str,
) -> torch.Tensor:
    """Final hidden states [m, d] of the target decoding its last prefix token and y_{1:m-1} on the mixed cache."""
    cache = mixed_cache(model, layout, sample, tensors, point)
    q = sample.target_ids.numel()
    ids = torch.cat([sample.target_ids[-1:], sample.continuation_ids[:-1]]).view(1, -1).to(model.device)
    positions = torch.arange(q - 1, q - 1 + ids.shape[1], device=model.device).view(1, -1)
    return decoder_of(model)(input_ids=ids, cache=cache, use_cache=True, position_ids=positions).last_hidden_state[0]


def teacher_hidden_cross(model: nn.Module, sample: CrossSample) -> torch.Tensor:
    """The target's own prefill of its rendering and y_{1:m-1}: final hidden states [m, d] (no grad)."""
    m = sample.continuation_ids.numel()
    ids = torch.cat([sample.target_ids, sample.continuation_ids[:-1]]).view(1, -1).to(model.device)
    with torch.no_grad():
        return decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0, -m:].detach()


def source_capture(source: Side, sample: CrossSample, point: str) -> Capture:
    """The source's capture of its whole rendering (boilerplate included: it conditions the content)."""
    return capture(source.model, source.layout, sample.source_ids, point)


def translated_tensors(translator: Translator, cap: Capture, sample: CrossSample) -> dict[str, list[torch.Tensor]]:
    """The translator applied to the content tokens of a source capture: name → per target layer [k, width]. A
    translator with token identity reads the aligned target ids (`aligned_token_ids`)."""
    content = {name: [x[sample.translated] for x in layers] for name, layers in cap.objects.items()}
    return translator.translate_objects(content, aligned_token_ids(sample))


def cross_sample_loss(
    translator: Translator, cap: Capture, target: Side, sample: CrossSample, objective: Objective,
    teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage-2 loss of one cross-tokenizer sample (KL through the frozen target over the mixed cache).

    Raises:
        ConfigError: an empty continuation.
    """
    check_continuation(sample)
    if teacher is None:
        teacher = teacher_hidden_cross(target.model, sample)
    student = student_hidden_cross(target.model, target.layout, sample, translated_tensors(translator, cap, sample),
                                   translator.point)
    return continuation_loss(target.model, student, teacher, sample.continuation_ids, objective)


CONTROL_CONDITIONS = ("translated", "boilerplate_only", "empty_prefix")


def cross_validation_kl(
    source: Side, target: Side, samples: Sequence[CrossSample], translator: Translator | None,
    *, condition: str = "translated", memo: ReferenceMemo | None = None,
) -> ValidationKL:
    """KL(target native ‖ condition) per continuation token over cross-tokenizer samples.

    condition: "translated" (mixed cache with the translator's content), "boilerplate_only" (the mixed cache with
    no content at all: what the target's own boilerplate alone gives) or "empty_prefix" (no cache: the target
    reads only its last prefix token, the same control as for same-tokenizer pairs). memo: as for
    `translators.stage1.validation_kl`.

    Raises:
        ConfigError: empty set, unknown condition, or "translated" without a translator.
    """
    if not samples:
        raise ConfigError("empty validation set: hold out at least one conversation (raise the sample count)")
    for sample in samples:
        check_continuation(sample)
    if condition not in CONTROL_CONDITIONS:
        raise ConfigError(f"unknown condition {condition!r}; choose from {', '.join(CONTROL_CONDITIONS)}")
    if condition == "translated" and translator is None:
        raise ConfigError("the translated condition needs a translator")
    model = target.model
    memo = ReferenceMemo(budget_bytes=0) if memo is None else memo
    means, firsts = [], []
    with torch.no_grad():
        for sample in samples:
            teacher = memo.get("teacher", sample, lambda: logits_from_hidden(model, teacher_hidden_cross(model, sample)))
            if condition == "empty_prefix":
                ids = torch.cat([sample.target_ids[-1:], sample.continuation_ids[:-1]]).view(1, -1).to(model.device)
                student = logits_from_hidden(model, decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0])
            else:
                tensors = None
                if condition == "translated":
                    cap = memo.get(f"capture:{translator.point}", sample,
                                   lambda: source_capture(source, sample, translator.point))
                    tensors = translated_tensors(translator, cap, sample)
                point = translator.point if translator is not None else "pre_norm"
                student = logits_from_hidden(model, student_hidden_cross(model, target.layout, sample, tensors, point))
            kl = kl_per_position(teacher, student)
            means.append(kl.mean().item())
            firsts.append(kl[0].item())
    return ValidationKL.of(means, firsts)


def alignment_summary(samples: Sequence[CrossSample]) -> dict[str, Any]:
    """What the artifact records about the alignment of its fitting data (JSON-able)."""
    translated = sum(int(s.translated.numel()) for s in samples)
    prefilled = sum(s.n_prefilled for s in samples)
    target_tokens = sum(int(s.target_ids.numel()) for s in samples)
    return {
        "method": "minimal mismatching groups; source tokens spread over target tokens; keys rotated at the "
                  "assigned target position; boilerplate prefilled by the target (KV-Lingo App. K)",
        "samples": len(samples),
        "translated_source_tokens": translated,
        "target_prefix_tokens": target_tokens,
        "target_prefilled_share": prefilled / target_tokens if target_tokens else 0.0,
    }


def validation_kl_for(
    source: Side, target: Side, samples: Sequence, translator: Translator | None, *, condition: str = "translated",
    memo: ReferenceMemo | None = None,
) -> ValidationKL:
    """Validation KL of same-tokenizer (prefix, continuation) pairs or of cross-tokenizer samples, by their type."""
    if samples and isinstance(samples[0], CrossSample):
        return cross_validation_kl(source, target, samples, translator, condition=condition, memo=memo)
    return validation_kl(source, target, samples, translator, condition=condition, memo=memo)


def accumulate_samples(
    stats: dict[str, GramStats], source: Side, target: Side, samples: Sequence, point: str, *,
    weighting: str = "uniform", on_sample: Callable[[int], None] | None = None, token_identity=None,
) -> dict[str, GramStats]:
    """Stage-1 statistics of same-tokenizer (prefix, continuation) pairs or of cross-tokenizer samples.

    token_identity: a `translators.token_identity.TokenIdentity`; across tokenizers the `ids` variant only (the
        aligned target ids, `aligned_token_ids`).

    Raises:
        ConfigError: the codebook on cross-tokenizer samples (it decodes the source's own vocabulary, which does
            not index the target's embedding).
    """
    if samples and isinstance(samples[0], CrossSample):
        if token_identity is not None and token_identity.variant != "ids":
            raise ConfigError(CROSS_CODEBOOK_ERROR)
        return accumulate_cross(stats, source, target, samples, point, on_sample=on_sample,
                                token_identity=token_identity, weighting=weighting)
    return accumulate_pair(stats, source, target, samples, point, weighting=weighting, on_sample=on_sample,
                           token_identity=token_identity)


# --- Reading a cross-tokenizer prefix under one condition: the switch runtime and the benchmarks ----------------

READ_CONDITIONS = ("target_native", "translated", "empty_prefix")


def prefix_cache(
    condition: str, source: Side | None, target: Side, sample: CrossSample, translator: Translator | None,
) -> tuple[DynamicCache, int]:
    """The target's cache of its prefix before its last token, under `condition`, and the position at which the
    last prefix token is read.

    target_native: the target prefills target_ids[:-1] itself. translated: the mixed cache (translated content,
    boilerplate prefilled). empty_prefix: no cache; the last prefix token is read at position 0, as the
    same-tokenizer control does.

    Raises:
        ConfigError: unknown condition, or translated without a source and translator.
    """
    if condition not in READ_CONDITIONS:
        raise ConfigError(f"unknown condition {condition!r}; choose from {', '.join(READ_CONDITIONS)}")
    model = target.model
    cache = DynamicCache(config=model.config)
    q = sample.target_ids.numel()
    if condition == "empty_prefix":
        return cache, 0
    if condition == "target_native":
        decoder_of(model)(input_ids=sample.target_ids[:-1].view(1, -1).to(model.device), cache=cache, use_cache=True)
        return cache, q - 1
    if source is None or translator is None:
        raise ConfigError("the translated condition needs the source model and a translator")
    tensors = translated_tensors(translator, source_capture(source, sample, translator.point), sample)
    return mixed_cache(model, target.layout, sample, tensors, translator.point), q - 1


def positioned_step(start: int):
    """A `generation.decode_from` step that feeds token t at position start + t: a mixed cache holds fewer or more
    entries than the positions it spans, so positions cannot be inferred from its length."""
    state = {"next": start}

    def step(model: nn.Module, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(state["next"], state["next"] + ids.numel(), device=model.device).view(1, -1)
        state["next"] += ids.numel()
        out = model(input_ids=ids.view(1, -1).to(model.device), cache=cache, use_cache=True, position_ids=positions,
                    logits_to_keep=1)
        return out.logits[0, -1]

    return step


def continuation_logprob(
    condition: str, source: Side | None, target: Side, sample: CrossSample, translator: Translator | None,
) -> float:
    """log p_target(continuation | prefix under `condition`), summed over the continuation's tokens (nats)."""
    with torch.no_grad():
        cache, position = prefix_cache(condition, source, target, sample, translator)
        ids = torch.cat([sample.target_ids[-1:], sample.continuation_ids[:-1]])
        positions = torch.arange(position, position + ids.numel(), device=target.model.device).view(1, -1)
        out = target.model(input_ids=ids.view(1, -1).to(target.model.device), cache=cache, use_cache=True,
                           position_ids=positions)
        log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
        return float(log_probs.gather(-1, sample.continuation_ids.view(-1, 1).to(log_probs.device)).sum())


def generate_cross(
    condition: str, source: Side | None, target: Side, sample: CrossSample, translator: Translator | None,
    settings: GenerationSettings,
) -> Decoded:
    """Decode the target's answer after the prefix under `condition` (the sample's continuation is not read): the
    last prefix token is read on the condition's cache, then the platform's one decoding loop continues."""
    with torch.no_grad():
        cache, position = prefix_cache(condition, source, target, sample, translator)
        first = positioned_step(position)
        logits = first(target.model, cache, sample.target_ids[-1:])
        return decode_from(target.model, cache, logits, settings, step=positioned_step(position + 1))
