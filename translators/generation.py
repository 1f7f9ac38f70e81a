"""Token-by-token generation on top of a cache: greedy or temperature/top-p sampling, stop ids, a budget.

The switch runtime, its re-prefill reference and the multi-turn conversation all decode through
`decode_from`, so every path picks tokens the same way and differences come only from the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from translators.errors import ConfigError
from translators.inject import decode_step


@dataclass(frozen=True)
class GenerationSettings:
    """How to continue after the first next-token distribution.

    temperature 0 means greedy (argmax); otherwise tokens are sampled from softmax(logits / temperature)
    restricted to the smallest set whose probability reaches `top_p`, with a torch.Generator seeded by `seed`.
    Generation stops after `max_new_tokens` tokens or right after emitting one of `stop_ids` (kept in the
    output, as transformers' `generate` does).
    """

    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        """Raises ConfigError naming every invalid field."""
        problems = []
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be a positive integer (the generation budget), got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if problems:
            raise ConfigError("invalid generation settings: " + "; ".join(problems))


@dataclass
class Decoded:
    """Tokens produced by `decode_from` and what it spent after the first token."""

    token_ids: list[int]
    stopped: str  # "stop_id" | "max_new_tokens"
    first_pick_s: float  # choosing the first token from the given logits
    decode_s: float  # every later step (forward + pick)
    step_s: list[float] = field(default_factory=list)  # per later step


def sync(device: torch.device | str) -> None:
    """Wait for queued GPU work so wall-clock timings cover it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def pick_token(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> int:
    """Choose the next token from one position's logits.

    Args:
        logits: [vocab].
        generator: CPU generator for sampling (unused when greedy).
    """
    if settings.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().float().cpu() / settings.temperature, dim=-1)  # [vocab]
    if settings.top_p < 1.0:
        probs = _top_p_filter(probs, settings.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest most-probable set whose mass reaches top_p (always ≥ 1 token): [vocab]."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0  # the token that crosses top_p is kept
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def make_generator(settings: GenerationSettings) -> torch.Generator | None:
    return None if settings.temperature == 0.0 else torch.Generator().manual_seed(settings.seed)


def decode_from(
    model: nn.Module,
    cache: DynamicCache,
    first_logits: torch.Tensor,
    settings: GenerationSettings,
    *,
    generator: torch.Generator | None = None,
    step: Callable[[nn.Module, DynamicCache, torch.Tensor], torch.Tensor] | None = None,
) -> Decoded:
    """Generate from `first_logits` (the prediction after the prefix) on top of `cache` (extended in place).

    The last emitted token is not fed back: its keys and values are computed by whoever reads it next.

    Args:
        first_logits: [vocab] logits for the first new token.
        step: forward of one token on the cache returning [vocab] logits; default `decode_step`.
    """
    step = step or (lambda m, c, ids: decode_step(m, c, ids, logits_to_keep=1)[-1])
    generator = generator if generator is not None else make_generator(settings)
    stops = set(settings.stop_ids)
    started = time.perf_counter()
    tokens = [pick_token(first_logits, settings, generator)]
    first_pick_s = time.perf_counter() - started
    step_s: list[float] = []
    while tokens[-1] not in stops and len(tokens) < settings.max_new_tokens:
        t0 = time.perf_counter()
        logits = step(model, cache, torch.tensor([tokens[-1]]))
        tokens.append(pick_token(logits, settings, generator))
        sync(first_logits.device)
        step_s.append(time.perf_counter() - t0)
    stopped = "stop_id" if tokens[-1] in stops else "max_new_tokens"
    return Decoded(token_ids=tokens, stopped=stopped, first_pick_s=first_pick_s, decode_s=sum(step_s), step_s=step_s)
