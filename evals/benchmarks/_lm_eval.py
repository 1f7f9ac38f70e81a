"""lm-eval benchmarks on local files (`evals.lm_eval_tasks`): one runner per task, scores keyed by lm-eval's
doc id under the task's own metric and filter (declared by the benchmark's module, never guessed from its name).

Not item-sharded (their specs leave `item_shards` False): lm-eval runs a task as a whole, taking the first
`limit` docs of the materialised data and numbering them itself (the doc ids that pair conditions), and batches
and reorders the task's requests; one Ray unit scores a condition's whole task."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from evals.benchmarks._spec import BenchContext
from translators.errors import ConfigError


def required_files(task: str) -> tuple[tuple[str, ...]]:
    """The task's accepted data files (any one of them) as a BenchmarkSpec.required_files entry."""
    from evals.lm_eval_tasks import LOCAL_TASKS

    return (LOCAL_TASKS[task].files,)


def lm_eval_item_scores(items: list[dict[str, Any]], metric: str, filter_name: str) -> dict[str, float]:
    """doc id -> `metric` of run_lm_eval's per-item records under one filter; records without the metric are
    left out (the condition did not score that item).

    Raises:
        ConfigError: a doc id appears twice under the filter.
    """
    scores: dict[str, float] = {}
    for item in items:
        if item.get("filter") != filter_name or item.get(metric) is None:
            continue
        doc_id = str(item["doc_id"])
        if doc_id in scores:
            raise ConfigError(f"lm-eval logged doc {doc_id} twice under filter {filter_name!r}: cannot pair it by id")
        scores[doc_id] = float(item[metric])
    return scores


def _tasks_dir(context: BenchContext, task: str, limit: int) -> Path:
    """The task YAML (and its `limit`-item data subset) written once per evaluation."""
    from evals.lm_eval_tasks import materialise_tasks

    def build() -> Path:
        out = Path(tempfile.mkdtemp(prefix=f"kvlingo-lm-eval-{task}-"))
        materialise_tasks(Path(context.data_dir), out, limit=limit, tasks=[task])
        return out

    return context.cached(("lm_eval_tasks", task, limit), build)


def runner(task: str, metric: str, filter_name: str = "none", generates: bool = False):
    """run(context, condition, limit) for one local lm-eval task.

    metric, filter_name: the per-item metric and the lm-eval filter it is read under ("none": the task has no
    filter list). generates: the task generates text (its budget is capped by the target's context).
    """

    def run(context, condition, limit: int) -> dict[str, float]:
        from evals.lm_eval_adapter import KvlingoLM
        from evals.lm_eval_tasks import run_lm_eval

        tasks_dir = _tasks_dir(context, task, limit)
        max_gen = min(64, context.target.layout.max_positions // 4)
        lm = KvlingoLM(condition, context.target.tokenizer, max_gen_toks=max_gen, show_progress=False)
        results = run_lm_eval(lm, [task], include_path=tasks_dir, limit=limit, per_item=True,
                              gen_kwargs={"max_gen_toks": max_gen} if generates else None)
        return lm_eval_item_scores(results[task]["items"], metric, filter_name)

    return run
