"""Stage 2 loss: self-distillation through the frozen target into the translator maps (eq. 3.3, Fig. 8).

Per sample: teacher = the target reading its own prefill of x_{1:n} then y; student = the target reading the
translated cache of the source's x_{1:n-1}, then x_n, then y. Loss = mean over the m continuation positions
of KL(teacher ‖ student) over the target's vocabulary; CE on y and KL + λ·CE are the App. U ablations.

Memory: full fp32 logits of a long continuation over a 262k vocabulary are gigabytes, so the decoder is run
once to hidden states and the LM head + loss are applied chunk by chunk under activation checkpointing: only
one chunk's logits are alive at a time, forward and backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from translators.capture import Capture
from translators.continuation import check_sample
from translators.errors import ConfigError
from translators.inject import write_cache
from translators.layout import CacheLayout, decoder_of
from translators.translator import Translator

OBJECTIVES = ("kl", "ce", "mixed")


@dataclass(frozen=True)
class Objective:
    name: str = "kl"
    ce_weight: float = 0.0  # λ of KL + λ·CE (objective "mixed")
    chunk: int = 128  # continuation positions per LM-head chunk

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.name!r}; choose from {', '.join(OBJECTIVES)}")
        if self.name == "mixed" and self.ce_weight <= 0:
            raise ConfigError("the mixed objective needs ce_weight > 0")
        if self.chunk < 1:
            raise ConfigError("chunk must be ≥ 1")


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's LM head (and Gemma's final soft-capping) on hidden states [k, d] → fp32 logits [k, vocab]."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def teacher_hidden(target: nn.Module, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states [m, d] of the target's own prefill at the m positions predicting y (no grad).

    Cheap to keep per sample across epochs (d floats per position instead of a vocabulary's worth).
    """
    check_sample(prefix_ids, continuation_ids)
    m = continuation_ids.numel()
    ids = torch.cat([prefix_ids, continuation_ids[:-1]]).view(1, -1).to(target.device)
    with torch.no_grad():
        return decoder_of(target)(input_ids=ids, use_cache=False).last_hidden_state[0, -m:].detach()


def student_hidden(
    target: nn.Module,
    layout: CacheLayout,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    point: str,
    prefix_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
) -> torch.Tensor:
    """Final hidden states [m, d] of the target reading x_n y_{1:m-1} on the injected cache of x_{1:n-1}.

    Args:
        tensors: cache object name → per target layer [n-1, width] (`inject.write_cache`).
    """
    cache = write_cache(target, layout, tensors, point=point)
    ids = torch.cat([prefix_ids[-1:], continuation_ids[:-1]]).view(1, -1).to(target.device)
    return decoder_of(target)(input_ids=ids, cache=cache, use_cache=True).last_hidden_state[0]


def _chunk_loss(
    model: nn.Module, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, kl_w: float, ce_w: float
) -> torch.Tensor:
    """Summed loss over one chunk of positions: kl_w·KL(teacher‖student) + ce_w·CE(labels)."""
    log_q = torch.log_softmax(logits_from_hidden(model, student), dim=-1)  # [k, V]
    total = student.new_zeros((), dtype=torch.float32)
    if kl_w:
        with torch.no_grad():
            log_p = torch.log_softmax(logits_from_hidden(model, teacher), dim=-1)
        total = total + kl_w * (log_p.exp() * (log_p - log_q)).sum()
    if ce_w:
        total = total - ce_w * log_q.gather(-1, labels.view(-1, 1)).sum()
    return total


def continuation_loss(
    target: nn.Module,
    student: torch.Tensor,
    teacher: torch.Tensor,
    continuation_ids: torch.Tensor,
    objective: Objective,
) -> torch.Tensor:
    """Mean per-position loss over the continuation, computed chunk by chunk (scalar, differentiable in
    `student` [m, d]; `teacher` [m, d] carries no gradient)."""
    kl_w = 0.0 if objective.name == "ce" else 1.0
    ce_w = {"kl": 0.0, "ce": 1.0, "mixed": objective.ce_weight}[objective.name]
    m = student.shape[0]
    labels = continuation_ids.to(student.device)
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, m, objective.chunk):
        sl = slice(start, start + objective.chunk)
        args = (target, student[sl], teacher[sl], labels[sl], kl_w, ce_w)
        # Recompute the chunk's logits in backward instead of storing them (the point of chunking).
        total = total + (checkpoint(_chunk_loss, *args, use_reentrant=False) if student.requires_grad else _chunk_loss(*args))
    return total / m


def sample_loss(
    translator: Translator,
    source_capture: Capture,
    target: nn.Module,
    target_layout: CacheLayout,
    prefix_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    objective: Objective,
    teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage-2 loss of one conversation; gradients flow only into the translator's maps.

    Args:
        source_capture: the source's capture of prefix_ids[:-1] at the translator's point (frozen source).
        teacher: cached `teacher_hidden` for this sample, or None to compute it now.
    Raises:
        ConfigError: prefix < 2 tokens or empty continuation.
    """
    check_sample(prefix_ids, continuation_ids)
    if teacher is None:
        teacher = teacher_hidden(target, prefix_ids, continuation_ids)
    translated = translator.translate_objects(source_capture.objects, source_capture.token_ids)
    student = student_hidden(target, target_layout, translated, translator.point, prefix_ids, continuation_ids)
    return continuation_loss(target, student, teacher, continuation_ids, objective)
