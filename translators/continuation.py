"""Scoring a continuation from a cache: the target's logits over y given the native or a translated prefix.

Both stage 2 (the loss) and the diagnostics (validation KL, first-token KL, controls) use these functions, so
the quantity trained is exactly the quantity reported.

Geometry (paper Fig. 8): the prefix is x_{1:n}, the continuation y_{1:m}. Teacher: the target prefills
x_{1:n} y_{1:m-1} itself. Student: the target reads a cache for x_{1:n-1} (translated from the source), then
runs x_n y_{1:m-1} on top of it. Both produce m next-token distributions, for y_1 … y_m.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from translators.errors import ConfigError
from translators.inject import build_cache, decode_step
from translators.layout import CacheLayout


def check_sample(prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> None:
    """Raises ConfigError for a prefix under two tokens or an empty continuation."""
    if prefix_ids.numel() < 2:
        raise ConfigError(f"a prefix needs at least two tokens (one cached, one decoded), got {prefix_ids.numel()}")
    if continuation_ids.numel() < 1:
        raise ConfigError("zero-length continuation: every sample needs at least one continuation token")


def teacher_logits(target: nn.Module, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """The target's own predictions for y_1..y_m after prefilling the prefix: [m, vocab]."""
    check_sample(prefix_ids, continuation_ids)
    m = continuation_ids.numel()
    ids = torch.cat([prefix_ids, continuation_ids[:-1]]).view(1, -1).to(target.device)
    return target(input_ids=ids, use_cache=False, logits_to_keep=m).logits[0]


def student_logits(
    target: nn.Module,
    layout: CacheLayout,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    point: str,
    prefix_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
) -> torch.Tensor:
    """Predictions for y_1..y_m from an injected cache of x_{1:n-1} (keys/values [n-1, d] per layer): [m, vocab].

    The GQA pair form; `cache_logits` on `inject.write_cache(...)` takes any layout's cache objects.
    Differentiable in keys and values (stage 2 backpropagates through the frozen target into the maps).
    """
    check_sample(prefix_ids, continuation_ids)
    return cache_logits(target, build_cache(target, layout, keys, values, point=point), prefix_ids, continuation_ids)


def cache_logits(target: nn.Module, cache: DynamicCache, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Predictions for y_1..y_m from a (translated) cache of x_{1:n-1}: the target runs x_n y_{1:m-1} on top of
    it (extending it in place): [m, vocab]. Differentiable in the tensors the cache was built from.

    Raises:
        ConfigError: prefix < 2 tokens or empty continuation.
    """
    check_sample(prefix_ids, continuation_ids)
    return decode_step(target, cache, torch.cat([prefix_ids[-1:], continuation_ids[:-1]]))


def no_prefix_logits(target: nn.Module, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Control `empty_prefix`: the target reads only x_n y_{1:m-1}, with no cache at all: [m, vocab]."""
    check_sample(prefix_ids, continuation_ids)
    ids = torch.cat([prefix_ids[-1:], continuation_ids[:-1]]).view(1, -1).to(target.device)
    return target(input_ids=ids, use_cache=False).logits[0]


def kl_per_position(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher ‖ student) in nats at each position, computed in fp32: [m]."""
    log_p = torch.log_softmax(teacher.float(), dim=-1)
    log_q = torch.log_softmax(student.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)
