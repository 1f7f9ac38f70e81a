"""recall: held-out synthetic recall items (personal facts, codes, short-text QA) in the chat format the embedded
models were trained on; the gold answer must appear in the answer's first line."""

from __future__ import annotations

from evals.benchmarks._common import first_line_has, fits, generate, messages_prompt
from evals.benchmarks._spec import BenchmarkSpec


def run(context, condition, limit: int) -> dict[str, float]:
    from infra.synthetic_chat import recall_items

    tokenizer = context.target.tokenizer
    items = context.cached(("recall_items", limit), lambda: recall_items(limit, seed=context.seed))
    scores = {}
    for i, item in enumerate(items):
        if not context.owns(i, len(items)):  # another item shard scores it (evaluation on Ray)
            continue
        ids = messages_prompt(tokenizer, item.messages)
        if not fits(context, ids, context.max_new_tokens):
            continue
        scores[str(i)] = first_line_has(generate(condition, tokenizer, ids, context.max_new_tokens), item.answer)
    return scores


SPEC = BenchmarkSpec(
    name="recall",
    suites=("data_free", "quick", "full"),
    metric="recall (gold in the answer's first line), fraction",
    higher_is_better=True,
    run=run,
    item_shards=True,
    description="held-out facts, codes and short-text questions from the embedded chat corpus",
)
