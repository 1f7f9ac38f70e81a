"""mt_bench_judge: MT-Bench single-answer grading (1–10) of each condition's answer to a question's first turn,
by an LLM judge (an OpenAI-compatible endpoint, or a zoo model run locally). A verdict that does not parse
leaves the question out of that condition (counted in the row's extra `n_unparseable`); a judge that cannot be
reached makes the benchmark an error entry while the other benchmarks' results are kept.

Not item-sharded (`item_shards` False): the judge (possibly a zoo model loaded locally) is built once per
evaluation and grades a condition's answers together, and the row's `n_unparseable` counts over all of them; one
Ray unit scores a condition's questions (a few dozen at most)."""

from __future__ import annotations

from evals.benchmarks import _common
from evals.benchmarks._spec import BenchmarkSpec, BenchmarkUnavailableError, ItemScores

FILES = ("mt_bench/question.jsonl", "mt_bench/judge_prompts.jsonl", "mt_bench/reference_answer/gpt-4.jsonl")
ANSWER_TOKEN_FACTOR = 4  # answers get 4 × --max-new-tokens


def _judge(context):
    from evals.judge import LocalHFJudge, OpenAICompatibleJudge

    url, model = context.options.get("judge_url"), context.options.get("judge_model")
    if url:
        return OpenAICompatibleJudge(url, model)
    from infra.zoo import load_model

    judged = load_model(model)
    return LocalHFJudge(judged.model, judged.tokenizer, max_new_tokens=64)


def run(context, condition, limit: int) -> ItemScores:
    from evals.judge import (
        JudgeUnavailableError,
        judge_answers,
        load_judge_templates,
        load_mt_bench_questions,
        mt_bench_items,
    )

    question_file, templates_file, reference_file = (context.data_file(f) for f in FILES)
    templates = context.cached("mt_bench_templates", lambda: load_judge_templates(templates_file))
    questions = context.cached(("mt_bench_questions", limit),
                               lambda: load_mt_bench_questions(question_file, reference_file, limit=limit))
    judge = context.cached("mt_bench_judge", lambda: _judge(context))
    tokenizer = context.target.tokenizer
    answers = {q.question_id: _common.generate(condition, tokenizer, _common.chat_prompt(tokenizer, q.turns[0]),
                                               context.max_new_tokens * ANSWER_TOKEN_FACTOR) for q in questions}
    try:
        result = judge_answers(judge, mt_bench_items(questions, answers), templates)
    except JudgeUnavailableError as err:
        raise BenchmarkUnavailableError(str(err)) from err
    return ItemScores(result.scores(), extra={"n_unparseable": result.n_unparseable})


def check(context) -> list[str]:
    if not context.options.get("judge_model"):
        return ["mt_bench_judge needs --judge-model (and --judge-url for an OpenAI-compatible endpoint)"]
    return []


SPEC = BenchmarkSpec(
    name="mt_bench_judge",
    suites=("full",),
    metric="judge rating 1–10",
    higher_is_better=True,
    run=run,
    required_files=FILES,
    check=check,
    description="MT-Bench first turns graded by an LLM judge (`--judge-model`, `--judge-url`)",
)
