"""Benchmark rows pair conditions by item id: a condition that fails an item the other scored (an unparseable
judge verdict, an lm-eval record without its metric) must not shift the pairing of the remaining items."""

import json
from types import SimpleNamespace

import pytest

import evals.benchmarks._common
import evals.judge
import evals.lm_eval_adapter
import evals.lm_eval_tasks
from evals.benchmarks import get
from evals.benchmarks._lm_eval import lm_eval_item_scores
from evals.metrics import paired_bootstrap_ci
from tasks.evaluate import EvalConfig, rows_for, score_benchmark
from translators.errors import ConfigError

TEMPLATES = [
    {"name": "single-v1", "type": "single", "system_prompt": "s", "output_format": "[[rating]]",
     "prompt_template": "Q {question} A {answer}"},
    {"name": "single-math-v1", "type": "single", "system_prompt": "s", "output_format": "[[rating]]",
     "prompt_template": "Q {question} R {ref_answer_1} A {answer}"},
]
# Judge ratings per condition and MT-Bench question id; None: the verdict does not parse.
# target_native fails question 2, distilled fails question 5.
RATINGS = {
    "target_native": {1: 5, 2: None, 3: 6, 4: 8, 5: 4, 6: 5},
    "distilled": {1: 4, 2: 9, 3: 6, 4: 7, 5: None, 6: 3},
}


def _rows(rows):
    return {row["condition"]: row for row in rows}


@pytest.fixture
def mt_bench_dir(tmp_path):
    root = tmp_path / "mt_bench"
    (root / "reference_answer").mkdir(parents=True)
    (root / "judge_prompts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEMPLATES))
    questions = [{"question_id": q, "category": "writing", "turns": [f"question{q}", "more"]} for q in range(1, 7)]
    (root / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (root / "reference_answer" / "gpt-4.jsonl").write_text("")
    return tmp_path


class _TableJudge:
    """Rates an answer "<condition>::question<q>" with RATINGS[condition][q]."""

    def __init__(self, base_url, model):
        del base_url, model

    def complete(self, system, user):
        condition, question = user.split(" A ", 1)[1].split("::")
        rating = RATINGS[condition][int(question.removeprefix("question"))]
        return "no verdict" if rating is None else f"Rating: [[{rating}]]"


def test_judge_rows_pair_questions_by_id(monkeypatch, mt_bench_dir):
    monkeypatch.setattr(evals.judge, "OpenAICompatibleJudge", _TableJudge)
    monkeypatch.setattr(evals.benchmarks._common, "chat_prompt", lambda tokenizer, text: text)
    monkeypatch.setattr(evals.benchmarks._common, "generate", lambda condition, tokenizer, prompt, n: f"{condition}::{prompt}")
    config = EvalConfig(source="s", target="t", data_dir=mt_bench_dir, limit=6, judge_url="http://127.0.0.1:9/v1",
                        judge_model="judge")
    context = config.context(None, SimpleNamespace(tokenizer=None))
    spec = get("mt_bench_judge")
    assert spec.run(context, "distilled", 6) == {"1": 4.0, "2": 9.0, "3": 6.0, "4": 7.0, "6": 3.0}

    conditions = {"target_native": "target_native", "distilled": "distilled"}
    rows = _rows(score_benchmark(spec, context, conditions, 6))
    native, distilled = rows["target_native"], rows["distilled"]
    assert (native["score"], native["n"], native["ci_low"]) == (pytest.approx(28 / 5), 5, None)
    assert (distilled["score"], distilled["n"]) == (pytest.approx(29 / 5), 5)
    # Questions 1, 3, 4, 6 are rated in both: differences -1, 0, -1, -2.
    delta, low, high = paired_bootstrap_ci([4.0, 6.0, 7.0, 3.0], [5.0, 6.0, 8.0, 5.0])
    assert distilled["extra"]["delta"] == pytest.approx(-1.0) and delta == pytest.approx(-1.0)
    assert (distilled["extra"]["delta"], distilled["ci_low"], distilled["ci_high"]) == (delta, low, high)
    assert distilled["extra"]["n_paired"] == 4 and distilled["extra"]["n_unparseable"] == 1


# lm-eval per-item records per task and condition (run_lm_eval(..., per_item=True)["<task>"]["items"]).
# ARC: target_native has no metric for doc 2, distilled logged no record for doc 5.
# GSM8K: the strict-match filter scores; flexible-extract records (all correct) must not be read.
LM_EVAL_ITEMS = {
    "kvlingo_arc_challenge": {
        "target_native": [{"doc_id": d, "filter": "none", "acc": a} for d, a in
                          [(0, 1.0), (1, 1.0), (2, None), (3, 0.0), (4, 1.0), (5, 0.0)]],
        "distilled": [{"doc_id": d, "filter": "none", "acc": a} for d, a in
                      [(4, 0.0), (3, 0.0), (2, 1.0), (1, 1.0), (0, 0.0)]],
    },
    "kvlingo_gsm8k": {
        "target_native": [{"doc_id": d, "filter": "strict-match", "exact_match": a} for d, a in
                          [(0, 1.0), (1, 0.0), (2, None), (3, 1.0)]]
                         + [{"doc_id": d, "filter": "flexible-extract", "exact_match": 1.0} for d in range(4)],
        "distilled": [{"doc_id": d, "filter": "strict-match", "exact_match": a} for d, a in [(0, 1.0), (1, 1.0), (2, 0.0)]]
                     + [{"doc_id": d, "filter": "flexible-extract", "exact_match": 1.0} for d in range(4)],
    },
}


class _FakeLM:
    def __init__(self, condition, tokenizer, **kwargs):
        self.condition = condition


def _fake_run_lm_eval(lm, task_names, include_path=None, limit=None, *, per_item=False, gen_kwargs=None):
    return {task: {"items": LM_EVAL_ITEMS[task][lm.condition]} for task in task_names}


def test_lm_eval_rows_pair_docs_by_id(monkeypatch, tmp_path):
    monkeypatch.setattr(evals.lm_eval_adapter, "KvlingoLM", _FakeLM)
    monkeypatch.setattr(evals.lm_eval_tasks, "materialise_tasks", lambda *args, **kwargs: {})
    monkeypatch.setattr(evals.lm_eval_tasks, "run_lm_eval", _fake_run_lm_eval)
    config = EvalConfig(source="s", target="t", data_dir=tmp_path, limit=6)
    context = config.context(None, SimpleNamespace(tokenizer=None, layout=SimpleNamespace(max_positions=512)))
    conditions = ("target_native", "distilled")
    # Each benchmark's module names its own lm-eval metric and filter (acc / none, exact_match / strict-match).
    scores = {name: {c: get(name).run(context, c, 6) for c in conditions} for name in ("arc_challenge", "gsm8k")}
    assert scores["gsm8k"] == {"target_native": {"0": 1.0, "1": 0.0, "3": 1.0},
                               "distilled": {"0": 1.0, "1": 1.0, "2": 0.0}}

    arc = _rows(rows_for("arc_challenge", scores["arc_challenge"]))["distilled"]
    # Docs 0, 1, 3, 4 are scored in both: differences -1, 0, 0, -1.
    delta, low, high = paired_bootstrap_ci([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0])
    assert arc["extra"]["delta"] == pytest.approx(-0.5) and delta == pytest.approx(-0.5)
    assert (arc["extra"]["delta"], arc["ci_low"], arc["ci_high"], arc["extra"]["n_paired"]) == (delta, low, high, 4)
    assert (arc["score"], arc["n"]) == (pytest.approx(0.4), 5)

    gsm8k = _rows(rows_for("gsm8k", scores["gsm8k"]))["distilled"]
    # Docs 0 and 1 under strict-match: differences 0, +1.
    delta, low, high = paired_bootstrap_ci([1.0, 1.0], [1.0, 0.0])
    assert gsm8k["extra"]["delta"] == pytest.approx(0.5)
    assert (gsm8k["extra"]["delta"], gsm8k["ci_low"], gsm8k["ci_high"], gsm8k["extra"]["n_paired"]) == (delta, low, high, 2)


def test_rows_without_two_shared_items_carry_no_ci_and_duplicate_docs_are_refused():
    rows = _rows(rows_for("recall", {"target_native": {"a": 1.0, "b": 0.0}, "distilled": {"b": 1.0, "c": 0.0}}))
    assert rows["distilled"]["ci_low"] is None and rows["distilled"]["score"] == 0.5
    with pytest.raises(ConfigError, match="doc 3 twice"):
        lm_eval_item_scores([{"doc_id": 3, "filter": "none", "acc": 1.0}] * 2, "acc", "none")
