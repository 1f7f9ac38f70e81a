"""needle: needle-in-a-haystack retrieval in the chat format the embedded models were trained on.

RULER's needle items (a long instruction, "special magic numbers" in a noise or essay haystack) are a format
the embedded tiny models never saw, so they score 0 under every condition and show nothing. Here the haystack
is a held-out conversation of the embedded corpus (a short text, personal facts, codes, small talk: the opening
of `infra.synthetic_chat.handoff_conversations`), the needle is one more "Remember: The code for KEY-NN is
NNNN." exchange with distractor codes beside it, placed at the start, middle or end of the conversation, and
the question asks for one of its codes. Recall: the code appears in the answer's first line.

Every model with a chat template reads the items in its own template, so the benchmark also runs on real pairs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from evals.benchmarks._common import first_line_has, fits, generate, messages_prompt
from evals.benchmarks._spec import BenchmarkSpec

# Held-out hand-off conversations under a seed away from `kvlingo bench multiturn`'s (its --seed, 0 by default).
HAYSTACK_SEED_OFFSET = 20_000
DEPTHS = (0.0, 0.5, 1.0)  # the needle's place among the haystack's exchanges: first, middle, last
ANSWER_TOKENS = 8  # a four-digit code and its period


@dataclass(frozen=True)
class NeedleItem:
    """messages end with the question; gold is the code; depth is where the needle exchange sits (0 first, 1 last)."""

    messages: list[dict]
    gold: str
    key: str
    depth: float


def needle_items(n: int, seed: int = 0) -> list[NeedleItem]:
    """n deterministic items; depths cycle through DEPTHS, keys are absent from their haystack."""
    from infra.synthetic_chat import (
        CODE_RANGE,
        ECHO_PREFIXES,
        NEEDLE_KEYS,
        SMALL_TALK,
        SUFFIX_RANGE,
        handoff_conversations,
    )

    items = []
    for index, conversation in enumerate(handoff_conversations(n, 1, HAYSTACK_SEED_OFFSET + seed)):
        rng = random.Random(f"kvlingo-needle/{seed}/{index}")
        exchanges = [conversation.opening[i : i + 2] for i in range(0, len(conversation.opening), 2)]
        if rng.random() < 0.5:  # small talk puts distance between the needle and the question, as in the corpus
            said, reply = rng.choice(SMALL_TALK)
            exchanges.insert(rng.randint(0, len(exchanges)), [{"role": "user", "content": said},
                                                              {"role": "assistant", "content": reply}])
        haystack = " ".join(m["content"] for m in conversation.opening)
        words = [w for w in NEEDLE_KEYS if w not in haystack]
        count = rng.randint(2, 4)
        keys = [f"{word}-{rng.randint(*SUFFIX_RANGE)}" for word in rng.sample(words, count)]
        codes = [str(rng.randint(*CODE_RANGE)) for _ in keys]
        text = " ".join(f"The code for {k} is {c}." for k, c in zip(keys, codes))
        opener = rng.choice(("Remember:", "Please remember these codes.", "Keep these safe."))  # the corpus's openers
        needle = [{"role": "user", "content": f"{opener} {text}"},
                  {"role": "assistant", "content": f"{rng.choice(ECHO_PREFIXES)} {text}"}]
        depth = DEPTHS[index % len(DEPTHS)]
        exchanges.insert(round(depth * len(exchanges)), needle)
        asked = rng.randrange(count)
        messages = [m for exchange in exchanges for m in exchange]
        messages.append({"role": "user", "content": f"What is the code for {keys[asked]}?"})
        items.append(NeedleItem(messages=messages, gold=codes[asked], key=keys[asked], depth=depth))
    return items


def run(context, condition, limit: int) -> dict[str, float]:
    tokenizer = context.target.tokenizer
    items = context.cached(("needle_items", limit), lambda: needle_items(limit, context.seed))
    scores = {}
    for i, item in enumerate(items):
        if not context.owns(i, len(items)):  # another item shard scores it (evaluation on Ray)
            continue
        ids = messages_prompt(tokenizer, item.messages)
        if not fits(context, ids, ANSWER_TOKENS):
            continue
        scores[str(i)] = first_line_has(generate(condition, tokenizer, ids, ANSWER_TOKENS), item.gold)
    return scores


SPEC = BenchmarkSpec(
    name="needle",
    suites=("data_free", "quick", "full"),
    metric="recall (code in the answer's first line), fraction",
    higher_is_better=True,
    run=run,
    item_shards=True,
    description="a code among distractors at the start, middle or end of a held-out embedded-format conversation",
)
