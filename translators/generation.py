"""Token-by-token generation on top of a cache: greedy or temperature/top-p sampling, stop ids, a budget.

`decode_from` is the platform's one decoding loop: the switch runtime, its re-prefill reference, the multi-turn
conversation, the timing harness and the evaluation conditions (`evals.conditions.greedy_generate`) all decode
through it, so every path picks tokens the same way and differences come only from the caches.

Stop semantics (everywhere): a stop id ends generation and IS included as the last returned token (as
transformers' `generate` returns it), and `Decoded.stopped` says why generation ended. The budget
`max_new_tokens` counts every returned token, the stop id included. Callers that want the answer's text decode
with `skip_special_tokens=True`, or drop the last token when `stopped == "stop_id"` (`Decoded.answer_ids`).
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
    output, as transformers' `generate` does; see the module docstring).
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

    token_ids: list[int]  # a final stop id included
    stopped: str  # "stop_id" | "should_stop" | "max_new_tokens"
    first_pick_s: float  # choosing the first token from the given logits
    decode_s: float  # every later step (forward + pick)
    step_s: list[float] = field(default_factory=list)  # per later step

    @property
    def answer_ids(self) -> list[int]:
        """The generated tokens without the final stop id (all of them when no stop id ended generation)."""
        return self.token_ids[:-1] if self.stopped == "stop_id" else list(self.token_ids)


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
    should_stop: Callable[[list[int]], bool] | None = None,
) -> Decoded:
    """Generate from `first_logits` (the prediction after the prefix) on top of `cache` (extended in place).

    Stops right after a stop id (which is returned), when `should_stop` says so, or at `max_new_tokens` tokens
    (module docstring). The last emitted token is not fed back: its keys and values are computed by whoever
    reads it next, so a cache of n tokens ends at n + len(token_ids) - 1.

    Args:
        first_logits: [vocab] logits for the first new token.
        step: forward of one token on the cache returning [vocab] logits; default `decode_step`.
        should_stop: called with the tokens so far after each token that is not a stop id; True ends
            generation (stop strings, which need the decoded text).
    """
    step = step or (lambda m, c, ids: decode_step(m, c, ids, logits_to_keep=1)[-1])
    generator = generator if generator is not None else make_generator(settings)
    stops = set(settings.stop_ids)
    started = time.perf_counter()
    tokens = [pick_token(first_logits, settings, generator)]
    first_pick_s = time.perf_counter() - started
    step_s: list[float] = []
    while (stopped := _why_stop(tokens, stops, settings.max_new_tokens, should_stop)) is None:
        t0 = time.perf_counter()
        logits = step(model, cache, torch.tensor([tokens[-1]]))
        tokens.append(pick_token(logits, settings, generator))
        sync(first_logits.device)
        step_s.append(time.perf_counter() - t0)
    return Decoded(token_ids=tokens, stopped=stopped, first_pick_s=first_pick_s, decode_s=sum(step_s), step_s=step_s)


def _why_stop(tokens: list[int], stops: set[int], budget: int,
              should_stop: Callable[[list[int]], bool] | None) -> str | None:
    """Why generation ends after `tokens` ("stop_id" | "should_stop" | "max_new_tokens"), or None to go on."""
    if tokens[-1] in stops:
        return "stop_id"
    if should_stop is not None and should_stop(tokens):
        return "should_stop"
    if len(tokens) >= budget:
        return "max_new_tokens"
    return None
