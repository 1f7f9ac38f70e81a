"""xquad_multiturn: CoQA-style grounded multi-turn QA built from XQuAD paragraphs; every turn is one switch
(the conversation so far, gold answers included, is the context): token F1 per turn. Items are conversations,
so it also runs on cross-tokenizer pairs (each model renders them in its own format)."""

from __future__ import annotations

from evals.benchmarks._common import generate_messages
from evals.benchmarks._spec import BenchmarkSpec

DATA_FILE = "xquad/xquad.en.json"
MAX_TURNS = 3


def run(context, condition, limit: int) -> dict[str, float]:
    from evals.qa import chat_messages, load_xquad, score_turn

    conversations = context.cached(("xquad", limit), lambda: load_xquad(context.data_file(DATA_FILE), limit=limit,
                                                                          max_turns=MAX_TURNS))
    scores = {}
    for c, conv in enumerate(conversations):
        if not context.owns(c, len(conversations)):  # another item shard scores it (evaluation on Ray)
            continue
        golds = [turn.golds[0] for turn in conv.turns]
        for t, turn in enumerate(conv.turns):
            answer = generate_messages(context, condition, chat_messages(conv, golds[:t]), context.max_new_tokens)
            if answer is None:  # does not fit the pair
                continue
            scores[f"{conv.id}/{t}"] = score_turn(answer, turn)["f1"]
    return scores


SPEC = BenchmarkSpec(
    name="xquad_multiturn",
    suites=("quick", "full"),
    metric="token F1 per turn, fraction",
    higher_is_better=True,
    run=run,
    item_shards=True,
    required_files=(DATA_FILE,),
    conversations=True,
    description="XQuAD (en) paragraphs as multi-turn grounded QA, one switch per turn",
)
