"""Prefect tasks that log to MLflow and register translators (thin calls into registry/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="log-run", cache_policy=NO_CACHE)
def log_run_task(summary: dict, config: dict, *, parent_run_id: str | None = None, tags: dict | None = None,
                 bench_rows: list | None = None) -> str:
    from registry.tracking import log_benchmark_rows, log_fit_run, tracking_client

    run_id = log_fit_run(summary, config, Path(summary["run_dir"]), parent_run_id=parent_run_id)
    client = tracking_client()
    for key, value in (tags or {}).items():
        client.set_tag(run_id, key, str(value))
    if bench_rows:
        log_benchmark_rows(run_id, bench_rows)
    return run_id


@task(name="register-translator", cache_policy=NO_CACHE)
def register_task(artifact_dir: str, run_id: str) -> dict[str, Any]:
    """Register the translator as `<source>--<target>` (alias candidate), then promote the best to champion."""
    from registry.tracking import log_translator_model, promote_best

    uri = log_translator_model(artifact_dir, run_id=run_id)
    name = uri.split("/")[1]
    return {"model_uri": uri, "name": name, "champion": promote_best(name)}


@task(name="find-cell", cache_policy=NO_CACHE)
def finished_cell_task(cell_key: str, experiment_name: str) -> dict[str, Any] | None:
    """A sweep cell already trained and logged in the pair's experiment (tag kvlingo.cell = the cell's run
    fingerprint), so re-running the sweep trains nothing; another config, data or model build never matches."""
    from registry.tracking import tracking_client

    client = tracking_client()
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`kvlingo.cell` = '{cell_key}'", max_results=1)
    if not runs:
        return None
    run = runs[0]
    return {"run_id": run.info.run_id, "val_kl": run.data.metrics.get("val_kl.distilled")}


@task(name="log-result", cache_policy=NO_CACHE)
def log_result_task(kind: str, result: dict) -> str:
    """Log a multi-turn ("multiturn") or switch-speed ("speed") result as an MLflow run (registry.bench_runs)."""
    from registry.bench_runs import log_multiturn_run, log_speed_run

    return {"multiturn": log_multiturn_run, "speed": log_speed_run}[kind](result)


@task(name="report-page", cache_policy=NO_CACHE)
def report_page_task(path: Path) -> dict[str, Any]:
    from registry.html_report import write_html_report

    return write_html_report(path)
