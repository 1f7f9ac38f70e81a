"""The local MMLU-Pro / ARC-Challenge / GSM8K task YAMLs on the real offline data files (../shared/data)."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
from lm_eval.api.model import LM
from tiny_configs import tiny_model, tiny_tokenizer

from evals.conditions import target_native
from evals.lm_eval_adapter import KvlingoLM
from evals.lm_eval_tasks import LOCAL_TASKS, materialise_tasks, run_lm_eval
from translators.errors import ConfigError
from translators.layout import cache_layout
from translators.stage1 import Side

pytestmark = pytest.mark.integration

TASKS = ["kvlingo_mmlu_pro", "kvlingo_arc_challenge", "kvlingo_gsm8k"]
LETTERS = "ABCDEFGHIJ"


def read_jsonl(path: Path, n: int) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


class OracleLM(LM):
    """Answers every item correctly from the data itself: proves the YAMLs wire questions to gold answers.

    Multiple choice: log-likelihood 0 for the gold continuation, -1 otherwise. Generation: the reference
    solution (ending "#### N").
    """

    def __init__(self, gold_continuation: dict[str, str], solutions: dict[str, str]):
        super().__init__()
        self.gold_continuation, self.solutions = gold_continuation, solutions

    def _lookup(self, table: dict[str, str], context: str) -> str:
        matches = [value for key, value in table.items() if key in context]
        assert len(matches) == 1, context  # test double: each context holds exactly one known question
        return matches[0]

    def loglikelihood(self, requests):
        out = []
        for context, continuation in (r.args for r in requests):
            right = continuation == self._lookup(self.gold_continuation, context)
            out.append((0.0 if right else -1.0, right))
        return out

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        return [self._lookup(self.solutions, r.args[0]) for r in requests]


def oracle_for(data_dir: Path, n: int) -> OracleLM:
    gold = {}
    for doc in read_jsonl(data_dir / LOCAL_TASKS["kvlingo_mmlu_pro"].files[0], n):
        gold[doc["question"].strip()] = " " + LETTERS[doc["answer_index"]]
    for doc in read_jsonl(data_dir / LOCAL_TASKS["kvlingo_arc_challenge"].files[0], n):
        labels = [c["label"] for c in doc["question"]["choices"]]
        gold[doc["question"]["stem"].strip()] = " " + doc["question"]["choices"][labels.index(doc["answerKey"])]["text"]
    solutions = {doc["question"]: doc["answer"] for doc in read_jsonl(data_dir / "gsm8k/test.jsonl", n)}
    return OracleLM(gold, solutions)


def test_local_tasks_run_on_real_files_with_a_tiny_model(shared_data, tmp_path):
    # Full files (no subset): the YAMLs must parse every record of the real data.
    paths = materialise_tasks(shared_data, tmp_path / "tasks")
    assert sorted(paths) == sorted(TASKS) and all(p.is_file() for p in paths.values())
    model = tiny_model("llama")
    lm = KvlingoLM(target_native(Side(model, cache_layout(model))), tiny_tokenizer(), show_progress=False)
    results = run_lm_eval(lm, TASKS, tmp_path / "tasks", limit=3, gen_kwargs={"max_gen_toks": 8})
    assert all(results[name]["n"] == 3 for name in TASKS)
    scores = [
        results["kvlingo_mmlu_pro"]["acc"],
        results["kvlingo_arc_challenge"]["acc"],
        results["kvlingo_arc_challenge"]["acc_norm"],
        results["kvlingo_gsm8k"]["exact_match/strict-match"],
        results["kvlingo_gsm8k"]["exact_match/flexible-extract"],
    ]
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_an_oracle_scores_perfectly_so_gold_answers_are_wired_right(shared_data, tmp_path):
    paths = materialise_tasks(shared_data, tmp_path, limit=3)
    assert all(len(read_jsonl(tmp_path / "data" / f"{name}.jsonl", 10)) == 3 for name in paths)
    results = run_lm_eval(oracle_for(shared_data, 3), TASKS, tmp_path, limit=3)
    assert results["kvlingo_mmlu_pro"]["acc"] == 1.0
    assert results["kvlingo_arc_challenge"]["acc"] == 1.0
    assert results["kvlingo_gsm8k"]["exact_match/strict-match"] == 1.0
    assert results["kvlingo_gsm8k"]["exact_match/flexible-extract"] == 1.0


def test_missing_data_dir_names_the_path(tmp_path):
    missing = tmp_path / "no-such-data"
    with pytest.raises(ConfigError, match=str(missing)):
        materialise_tasks(missing, tmp_path / "tasks")


def test_missing_files_are_reported_together_with_hub_ids(shared_data, tmp_path):
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    shutil.copy(shared_data / "gsm8k" / "test.jsonl", data / "gsm8k" / "test.jsonl")
    with pytest.raises(ConfigError) as err:
        materialise_tasks(data, tmp_path / "tasks")
    message = str(err.value)
    assert str(data / "mmlu_pro" / "test.jsonl.gz") in message and "TIGER-Lab/MMLU-Pro" in message
    assert "allenai/ai2_arc" in message and "ARC-Challenge" in message
    assert "kvlingo_gsm8k" not in message
    assert list(materialise_tasks(data, tmp_path / "tasks", tasks=["kvlingo_gsm8k"])) == ["kvlingo_gsm8k"]
