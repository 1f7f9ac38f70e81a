"""needle_codes: a random code hidden in filler text, for any pair (cross-tokenizer included).

Each item is one user message: filler sentences with "The secret code is NNNNNN." placed at a depth (10%, 50% or
90% of the sentences) in a haystack of one of two lengths, then the question. Two scores per item:

- recall: the code appears in the greedy answer (every condition);
- gap: how much of the native log-probability gap the condition recovers. With lp(c) = log p_target(answer | …)
  of the answer "The secret code is NNNNNN." under condition c, and lp_none the target's own log-probability of
  that answer on the same haystack WITHOUT the needle, the item scores lp(c) − lp_none (nats): target-native scores
  the full gap; a cache that carries the code recovers a share of it; a cache that lost it scores about 0. The
  condition's row extra `gap_share` is Σ(lp(c) − lp_none) / Σ(lp_native − lp_none) over its items.
  source_native has no gap score (its log-probabilities are over another vocabulary).

Data-free: the filler and codes are generated from the seed (≥ 100 items with --limit 100 or more).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from evals.benchmarks._common import answer_logprob, generate_messages
from evals.benchmarks._spec import BenchmarkSpec, ItemScores

DEPTHS = (0.1, 0.5, 0.9)
LENGTHS = (12, 30)  # filler sentences: about 130 and 320 tokens
ANSWER_TOKENS = 16
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river flows to the sea.", "A cat sleeps on the mat.", "The train leaves at noon.",
    "Bread is baked in the morning.", "The old bridge is made of stone.", "Birds sing in the trees.",
    "The library opens at nine.", "Snow falls in the mountains.", "The market is busy today.",
)
QUESTION = "What is the secret code in the text above? Answer with the code."


@dataclass(frozen=True)
class CodeItem:
    haystack: str  # with the needle
    plain: str  # the same filler without it
    code: str
    depth: float
    length: int

    def messages(self, with_needle: bool = True) -> list[dict]:
        return [{"role": "user", "content": f"{self.haystack if with_needle else self.plain}\n\n{QUESTION}"}]

    @property
    def answer(self) -> str:
        return f"The secret code is {self.code}."


def code_items(n: int, seed: int = 0) -> list[CodeItem]:
    """n deterministic items cycling through every (length, depth) cell, each with its own random code."""
    items = []
    for index in range(n):
        rng = random.Random(f"kvlingo-needle-codes/{seed}/{index}")
        length = LENGTHS[index // len(DEPTHS) % len(LENGTHS)]
        depth = DEPTHS[index % len(DEPTHS)]
        sentences = [rng.choice(FILLER) for _ in range(length)]
        code = str(rng.randint(100_000, 999_999))
        cut = round(depth * length)
        needle = f"The secret code is {code}."
        items.append(CodeItem(haystack=" ".join(sentences[:cut] + [needle] + sentences[cut:]),
                              plain=" ".join(sentences), code=code, depth=depth, length=length))
    return items


def run(context, condition, limit: int) -> ItemScores:
    items = context.cached(("needle_codes", limit), lambda: code_items(limit, context.seed))
    scores: dict[str, float] = {}
    recovered = native_gap = 0.0
    for i, item in enumerate(items):
        answer = generate_messages(context, condition, item.messages(), ANSWER_TOKENS)
        if answer is None:
            continue
        scores[f"recall/{i}"] = float(item.code in answer)
        if condition.name == "source_native":
            continue
        lp = answer_logprob(context, condition, item.messages(), item.answer)
        # The target's own log-probabilities with and without the needle are shared by every condition.
        native = context.cached(("needle_codes/native", i, limit), lambda: _native_logprobs(context, item))
        if lp is None or native is None:
            continue
        scores[f"gap/{i}"] = lp - native[1]
        recovered += lp - native[1]
        native_gap += native[0] - native[1]
    extra = {"gap_share": recovered / native_gap} if native_gap > 0 else {}
    return ItemScores(scores, extra=extra)


def _target_native(context):
    """The target-native condition of the pair in the context (cross-tokenizer or not)."""
    from evals.conditions import target_native
    from evals.cross_conditions import CrossCondition
    from infra.pairs import same_tokenizer
    from translators.stage1 import Side

    if same_tokenizer(context.source, context.target):
        return target_native(Side(context.target.model, context.target.layout))
    return CrossCondition("target_native", context.source, context.target)


def _native_logprobs(context, item: CodeItem) -> tuple[float, float] | None:
    """(lp with the needle, lp without it) of the answer, target-native."""
    native = _target_native(context)
    with_needle = answer_logprob(context, native, item.messages(True), item.answer)
    without = answer_logprob(context, native, item.messages(False), item.answer)
    return None if with_needle is None or without is None else (with_needle, without)


SPEC = BenchmarkSpec(
    name="needle_codes",
    suites=("full",),
    metric="recall (code in the answer), fraction; gap: nats of the native log-prob gap recovered",
    higher_is_better=True,
    run=run,
    row_groups=True,
    conversations=True,
    description="a six-digit code in filler at three depths and two lengths; recall and the share of the native "
                "log-prob gap (with vs without the needle) a condition recovers; any pair, cross-tokenizer included",
)
