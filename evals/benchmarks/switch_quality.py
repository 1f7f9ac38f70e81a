"""switch_quality: does the target continue after a switch as it does after its own prefill? On held-out switch
prefixes (`infra.prompts.heldout_prefixes`: embedded-format conversations cut where the assistant answers), the
greedy continuation under each condition is scored against the target-native greedy continuation by token F1
over token ids (`evals.switch_quality.token_id_f1`): 1.0 is a continuation the switch left unchanged (target
native scores 1.0 by definition)."""

from __future__ import annotations

from evals.benchmarks._common import fits
from evals.benchmarks._spec import BenchmarkSpec


def run(context, condition, limit: int) -> dict[str, float]:
    from evals.conditions import greedy_generate, target_native
    from evals.switch_quality import token_id_f1
    from infra.chat import stop_ids
    from infra.prompts import heldout_prefixes
    from translators.stage1 import Side

    target = context.target
    prefixes = context.cached(("heldout_prefixes", limit),
                              lambda: heldout_prefixes(target.tokenizer, limit, seed=context.seed))
    native = target_native(Side(target.model, target.layout))
    stops = stop_ids(target.tokenizer)
    scores = {}
    for i, ids in enumerate(prefixes):
        if not context.owns(i, len(prefixes)):  # another item shard scores it (evaluation on Ray)
            continue
        if not fits(context, ids, context.max_new_tokens):
            continue
        reference = context.cached(("switch_quality_native", limit, i),
                                   lambda ids=ids: greedy_generate(native, ids, context.max_new_tokens, stops))
        scores[str(i)] = token_id_f1(greedy_generate(condition, ids, context.max_new_tokens, stops), reference)
    return scores


SPEC = BenchmarkSpec(
    name="switch_quality",
    suites=("quick", "full"),
    metric="token F1 of the greedy continuation against the target's native one (token ids), fraction",
    higher_is_better=True,
    run=run,
    item_shards=True,
    description="held-out switch prefixes (`infra.prompts.heldout_prefixes`): continuation agreement after a switch",
)
