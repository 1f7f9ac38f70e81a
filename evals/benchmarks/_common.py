"""Helpers shared by benchmark runners: prompts in each model's own chat format, greedy generation to text."""

from __future__ import annotations

import torch

from evals.benchmarks._spec import BenchContext


def chat_prompt(tokenizer, user_text: str, answer_prefix: str = "") -> torch.Tensor:
    """[n] token ids of a one-turn chat (`infra.chat.render_chat`) ending where the answer starts."""
    from infra.chat import render_chat

    text = render_chat(tokenizer, [{"role": "user", "content": user_text}], generation_prompt=True)
    text = text + (answer_prefix if not answer_prefix or text.endswith((" ", "\n")) else " " + answer_prefix)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def messages_prompt(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[n] token ids of a conversation ending where the assistant's next answer starts (`infra.chat.chat_ids`)."""
    from infra.chat import chat_ids

    return chat_ids(tokenizer, messages, generation_prompt=True)


def generate(condition, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    """Greedy answer text under `condition` after the prompt ids [n], up to `infra.chat.stop_ids` (the decoder
    returns the stop token last; it is not part of the answer)."""
    from evals.conditions import greedy_generate
    from infra.chat import stop_ids

    stops = stop_ids(tokenizer)
    out = greedy_generate(condition, ids, max_new_tokens, stops)
    answer = out[:-1] if out and out[-1] in stops else out
    return tokenizer.decode(answer, skip_special_tokens=True)


def first_line_has(answer: str, gold: str) -> float:
    """1.0 when the gold (without a final period) occurs in the answer's first line, case-insensitively."""
    gold = gold.strip().rstrip(".").lower()
    return float(gold in answer.strip().split("\n")[0].lower())


def fits(context: BenchContext, ids: torch.Tensor, new_tokens: int) -> bool:
    """Whether a prompt plus `new_tokens` generated tokens fits every model of the pair."""
    limits = [m.layout.max_positions for m in (context.source, context.target) if m is not None]
    return ids.numel() + new_tokens <= min(limits)


# --- Conversation-level items: every pair, cross-tokenizer included (`evals.cross_conditions`) -------------------


def generate_messages(context: BenchContext, condition, messages: list[dict], max_new_tokens: int) -> str | None:
    """The greedy answer to `messages` under `condition`, or None when the item does not fit the pair. A
    same-tokenizer condition reads the target's rendering as token ids; a `CrossCondition` has each model render
    the conversation in its own format."""
    from evals.cross_conditions import CrossCondition
    from evals.cross_conditions import generate_messages as generate_cross

    if isinstance(condition, CrossCondition):
        return generate_cross(condition, messages, max_new_tokens)
    tokenizer = context.target.tokenizer
    ids = messages_prompt(tokenizer, messages)
    if not fits(context, ids, max_new_tokens):
        return None
    return generate(condition, tokenizer, ids, max_new_tokens)


def answer_logprob(context: BenchContext, condition, messages: list[dict], answer: str) -> float | None:
    """log p(answer | messages) in nats under a target-side condition (the answer as the target's format continues,
    `infra.chat.answer_text`), or None when the item does not fit the pair."""
    from evals.conditions import continuation_logprobs
    from evals.cross_conditions import CrossCondition
    from evals.cross_conditions import answer_logprob as cross_logprob

    if isinstance(condition, CrossCondition):
        return cross_logprob(condition, messages, answer)
    from infra.chat import answer_text

    tokenizer = context.target.tokenizer
    ids = messages_prompt(tokenizer, messages)
    answer_ids = tokenizer(answer_text(tokenizer, messages, answer), add_special_tokens=False)["input_ids"]
    if not fits(context, ids, len(answer_ids)):
        return None
    return float(continuation_logprobs(condition, ids, answer_ids).sum())
