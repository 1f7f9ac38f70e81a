"""RULER single-needle retrieval runners (`evals.ruler` items), one row per context length."""

from __future__ import annotations

from evals.benchmarks._common import chat_prompt, fits, generate
from evals.benchmarks._spec import BenchContext

DEFAULT_LENGTHS = (256, 512)
ANSWER_TOKENS = 12


def lengths(context: BenchContext) -> list[int]:
    return [int(n) for n in context.options.get("ruler_lengths") or DEFAULT_LENGTHS]


def check_lengths(context: BenchContext) -> list[str]:
    return ["ruler lengths must be ≥ 8 tokens"] if any(n < 8 for n in lengths(context)) else []


def runner(haystack: str, essay_file: str | None = None):
    """run(context, condition, limit): `limit` items per length, ids "<length>/<index>"; scores only the items of
    `context.shard` (the specs set item_shards)."""

    def run(context, condition, limit: int) -> dict[str, float]:
        from evals.ruler import build_ruler_items, score_ruler

        tokenizer = context.target.tokenizer

        def build():
            essay = context.data_file(essay_file) if essay_file else None
            return build_ruler_items(tokenizer, lengths(context), limit, haystack=haystack, essay_path=essay,
                                     seed=context.seed)

        items = context.cached(("ruler_items", haystack, limit), build)
        scores = {}
        for i, item in enumerate(items):
            if not context.owns(i, len(items)):  # another item shard scores it (evaluation on Ray)
                continue
            ids = chat_prompt(tokenizer, item.prompt(), item.answer_prefix)
            if not fits(context, ids, ANSWER_TOKENS):
                continue
            scores[f"{item.length}/{i}"] = score_ruler(generate(condition, tokenizer, ids, ANSWER_TOKENS), item)
        return scores

    return run
