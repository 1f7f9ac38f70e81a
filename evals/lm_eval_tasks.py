"""Benchmarks through lm-eval on local data files: MMLU-Pro, ARC-Challenge and GSM8K.

`materialise_tasks(data_dir, out_dir)` writes one runnable task YAML per benchmark into `out_dir`; each
includes its template from `evals/tasks/` and reads its test file from `data_dir` with lm-eval's
`dataset_path: json` (the `datasets` JSON builder, which also reads .jsonl.gz). `run_lm_eval` then runs a
`KvlingoLM` (or any lm-eval `LM`) on them and returns a compact per-task summary.

The local tasks are zero-shot: `kvlingo_mmlu_pro` and `kvlingo_arc_challenge` are multiple choice scored by
log-likelihood, `kvlingo_gsm8k` is greedy generation with exact match of the final number. With hub access,
lm-eval's built-in tasks `mmlu_pro` (TIGER-Lab/MMLU-Pro, 5-shot CoT), `arc_challenge` (allenai/ai2_arc) and
`gsm8k` (openai/gsm8k, 5-shot) run through the same `run_lm_eval` by name, downloading their data.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from translators.errors import ConfigError

TEMPLATE_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_BOOTSTRAP_ITERS = 1000  # only non-mean metrics (e.g. perplexity) bootstrap; means have a closed-form SE


@dataclass(frozen=True)
class LocalTask:
    """One benchmark as a local file under the data directory.

    files: accepted paths relative to the data directory, first existing one wins (the shared offline copy
        first, then what `datasets` writes with `.to_json(...)`).
    hub: where the data comes from and how to fetch it, for the missing-file message.
    builtin: lm-eval's own task of the same benchmark (hub data).
    """

    name: str
    template: str
    files: tuple[str, ...]
    hub: str
    builtin: str


LOCAL_TASKS: dict[str, LocalTask] = {
    task.name: task
    for task in (
        LocalTask(
            "kvlingo_mmlu_pro",
            "_kvlingo_mmlu_pro_yaml",
            ("mmlu_pro/test.jsonl.gz", "mmlu_pro/test.jsonl"),
            "TIGER-Lab/MMLU-Pro, split test: datasets.load_dataset('TIGER-Lab/MMLU-Pro', split='test')"
            ".to_json('<data_dir>/mmlu_pro/test.jsonl')",
            "mmlu_pro",
        ),
        LocalTask(
            "kvlingo_arc_challenge",
            "_kvlingo_arc_challenge_yaml",
            ("arc_challenge/ARC-Challenge-Test_qapredictions_dgem_default.jsonl", "arc_challenge/test.jsonl"),
            "allenai/ai2_arc, config ARC-Challenge, split test: datasets.load_dataset('allenai/ai2_arc', "
            "'ARC-Challenge', split='test').to_json('<data_dir>/arc_challenge/test.jsonl')",
            "arc_challenge",
        ),
        LocalTask(
            "kvlingo_gsm8k",
            "_kvlingo_gsm8k_yaml",
            ("gsm8k/test.jsonl",),
            "openai/gsm8k, config main, split test: datasets.load_dataset('openai/gsm8k', 'main', split='test')"
            ".to_json('<data_dir>/gsm8k/test.jsonl')",
            "gsm8k",
        ),
    )
}


def materialise_tasks(
    data_dir: Path, out_dir: Path, limit: int | None = None, tasks: Sequence[str] | None = None
) -> dict[str, Path]:
    """Write runnable lm-eval task YAMLs for the local benchmarks into `out_dir`.

    Args:
        data_dir: directory holding the benchmark files (e.g. ../shared/data); never assumed.
        out_dir: where the task YAMLs (with `limit`, the data subsets; once run, the `datasets` Arrow cache)
            are written; pass it to lm-eval as `TaskManager(include_path=out_dir)`.
        limit: when set, only the first `limit` items of each file are copied into out_dir/data and read from
            there (quick smoke runs parse a few lines instead of a whole benchmark).
        tasks: which of LOCAL_TASKS to write (default all).
    Returns:
        {task name: path of its YAML}.
    Raises:
        ConfigError: unknown task names, limit < 1, a missing data directory, or missing files (all reported
            at once, each with the paths tried and how to get the dataset).
    """
    names = list(LOCAL_TASKS) if tasks is None else list(tasks)
    unknown = [n for n in names if n not in LOCAL_TASKS]
    if unknown:
        raise ConfigError(f"unknown local task(s) {unknown}; known: {', '.join(LOCAL_TASKS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a positive integer or None, got {limit!r}")
    data_dir = Path(data_dir).expanduser().resolve()
    if not data_dir.is_dir():
        raise ConfigError(
            f"benchmark data directory {data_dir} does not exist; point the data-directory option at the folder "
            "holding mmlu_pro/, arc_challenge/ and gsm8k/ (or use lm-eval's hub tasks mmlu_pro, arc_challenge, gsm8k)"
        )
    found = {name: _find_file(LOCAL_TASKS[name], data_dir) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise ConfigError("\n".join(_missing_message(LOCAL_TASKS[name], data_dir) for name in missing))
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, path in found.items():
        if limit is not None:
            path = _write_subset(path, out_dir / "data" / f"{name}.jsonl", limit)
        written[name] = _write_task_yaml(LOCAL_TASKS[name], path, out_dir)
    return written


def _find_file(task: LocalTask, data_dir: Path) -> Path | None:
    """The first of the task's accepted files that exists under data_dir."""
    return next((data_dir / f for f in task.files if (data_dir / f).is_file()), None)


def _missing_message(task: LocalTask, data_dir: Path) -> str:
    tried = ", ".join(str(data_dir / f) for f in task.files)
    return (
        f"{task.name}: no data file (looked for {tried}). Get the dataset {task.hub}; or, with hub access, "
        f"run lm-eval's built-in task '{task.builtin}' instead."
    )


def _write_subset(source: Path, dest: Path, limit: int) -> Path:
    """Copy the first `limit` JSON lines of `source` (.jsonl or .jsonl.gz) to `dest` (.jsonl); returns dest."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as src, dest.open("w", encoding="utf-8") as out:
        kept = 0
        for line in src:
            if kept == limit:
                break
            if line.strip():
                json.loads(line)  # fail here, naming nothing vague later, if the file is not JSON lines
                out.write(line if line.endswith("\n") else line + "\n")
                kept += 1
    return dest


def _write_task_yaml(task: LocalTask, data_file: Path, out_dir: Path) -> Path:
    """The runnable task: includes its template (whose `!function utils.*` resolve beside the template)."""
    config = {
        "task": task.name,
        "include": str(TEMPLATE_DIR / task.template),
        "dataset_path": "json",
        # The Arrow cache `datasets` builds from the JSON lives beside the tasks, not in the user's HF cache.
        "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(out_dir / "datasets_cache")},
        "test_split": "test",
    }
    path = out_dir / f"{task.name}.yaml"
    header = f"# Written by evals.lm_eval_tasks.materialise_tasks; edit {TEMPLATE_DIR / task.template} instead.\n"
    path.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_lm_eval(
    lm: Any,
    task_names: Sequence[str],
    include_path: Path | str | None = None,
    limit: int | float | None = None,
    *,
    include_defaults: bool | None = None,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
    gen_kwargs: dict[str, Any] | None = None,
    per_item: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run lm-eval's `simple_evaluate` and summarise per task.

    Args:
        lm: an lm-eval `LM` instance (e.g. evals.lm_eval_adapter.KvlingoLM).
        task_names: lm-eval task names: the local `kvlingo_*` tasks (from `include_path`) and/or built-ins
            such as `mmlu_pro`, `arc_challenge`, `gsm8k` (these download from the hub).
        include_path: directory of task YAMLs (materialise_tasks's out_dir).
        limit: items per task (int) or fraction (< 1), as lm-eval takes it.
        include_defaults: also index lm-eval's built-in tasks (~7 s); default: only when some requested task
            is not a local `kvlingo_*` task.
        bootstrap_iters: draws for metrics without a closed-form standard error.
        gen_kwargs: overrides of generation tasks' generation_kwargs (e.g. {"max_gen_toks": 64}).
        per_item: also return each item's metric values (for paired comparisons across conditions).
    Returns:
        {task: {metric: value, f"{metric}_stderr": value or None, "n": items scored, ["items": [...]]}};
        a metric computed after a named filter is keyed "metric/filter" (e.g. "exact_match/strict-match").
    Raises:
        ConfigError: no task names, or tasks lm-eval cannot find (with where it looked).
    """
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    names = list(task_names)
    if not names:
        raise ConfigError("no task names given; e.g. kvlingo_mmlu_pro, kvlingo_arc_challenge, kvlingo_gsm8k")
    if include_defaults is None:
        include_defaults = include_path is None or any(not n.startswith("kvlingo_") for n in names)
    manager = TaskManager(include_path=str(include_path) if include_path else None, include_defaults=include_defaults)
    _check_known(manager, names, include_path)
    results = simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        gen_kwargs=gen_kwargs,
        log_samples=per_item,
    )
    return {name: _summarise(results, name, per_item) for name in names}


def _check_known(manager: Any, names: list[str], include_path: Path | str | None) -> None:
    """Raises ConfigError naming tasks the manager does not know, before any model work."""
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f"in {include_path} (run materialise_tasks first?)" if include_path else "among lm-eval's tasks"
        raise ConfigError(f"lm-eval does not know task(s) {unknown} {where}")


def _summarise(results: dict, name: str, per_item: bool) -> dict[str, Any]:
    """One task's metrics from simple_evaluate's results: "metric,filter" keys → "metric" or "metric/filter"."""
    raw = results["results"][name]
    summary: dict[str, Any] = {}
    for key, value in raw.items():
        if "," not in key:
            continue  # "alias" and other labels
        metric, filter_name = key.split(",", 1)
        stderr = metric.endswith("_stderr")
        base = metric.removesuffix("_stderr")
        label = base if filter_name == "none" else f"{base}/{filter_name}"
        summary[label + ("_stderr" if stderr else "")] = _number(value)
    summary["n"] = int(results["n-samples"][name]["effective"])
    if per_item:
        metrics = {key.split(",", 1)[0] for key in raw if "," in key and "_stderr," not in key}
        summary["items"] = [_item(sample, metrics) for sample in results.get("samples", {}).get(name, [])]
    return summary


def _item(sample: dict, metrics: set[str]) -> dict[str, Any]:
    """doc_id, filter and the metric values of one logged sample."""
    keep = {"doc_id": sample["doc_id"], "filter": sample.get("filter")}
    keep.update({k: _number(v) for k, v in sample.items() if k in metrics})
    return keep


def _number(value: Any) -> float | None:
    """Floats stay; lm-eval's "N/A" (no standard error) becomes None."""
    return float(value) if isinstance(value, (int, float)) else None
