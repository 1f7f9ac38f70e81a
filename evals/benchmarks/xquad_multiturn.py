"""xquad_multiturn: CoQA-style grounded multi-turn QA built from XQuAD paragraphs; every turn is one switch
(the conversation so far, gold answers included, is the context): token F1 per turn."""

from __future__ import annotations

from evals.benchmarks._common import fits, generate, messages_prompt
from evals.benchmarks._spec import BenchmarkSpec

DATA_FILE = "xquad/xquad.en.json"
MAX_TURNS = 3


def run(context, condition, limit: int) -> dict[str, float]:
    from evals.qa import chat_messages, load_xquad, score_turn

    tokenizer = context.target.tokenizer
    conversations = context.cached(("xquad", limit), lambda: load_xquad(context.data_file(DATA_FILE), limit=limit,
                                                                          max_turns=MAX_TURNS))
    scores = {}
    for c, conv in enumerate(conversations):
        if not context.owns(c, len(conversations)):  # another item shard scores it (evaluation on Ray)
            continue
        golds = [turn.golds[0] for turn in conv.turns]
        for t, turn in enumerate(conv.turns):
            ids = messages_prompt(tokenizer, chat_messages(conv, golds[:t]))
            if not fits(context, ids, context.max_new_tokens):
                continue
            scores[f"{conv.id}/{t}"] = score_turn(generate(condition, tokenizer, ids, context.max_new_tokens), turn)["f1"]
    return scores


SPEC = BenchmarkSpec(
    name="xquad_multiturn",
    suites=("quick", "full"),
    metric="token F1 per turn, fraction",
    higher_is_better=True,
    run=run,
    item_shards=True,
    required_files=(DATA_FILE,),
    description="XQuAD (en) paragraphs as multi-turn grounded QA, one switch per turn",
)
