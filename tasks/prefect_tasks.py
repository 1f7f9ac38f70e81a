"""The units of work of tasks/, each wrapped once as a Prefect task for the flows in flows/pipeline.py.

The plain CLI path (`kvlingo fit` without --track) calls the same functions directly (flows/fit.py)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.fit import FitPlan, distill, merge_stats, plan_fit, shard_stats, solve_closed_form, stats_key
from infra.config import FitConfig


@lru_cache(maxsize=4)
def cached_model(name: str):
    """Frozen models are read-only: tasks of one flow run (threads of one process) share one copy."""
    from infra.zoo import load_model

    return load_model(name)


@task(name="plan-fit", cache_policy=NO_CACHE)
def plan_task(config: FitConfig) -> FitPlan:
    return plan_fit(config, loader=cached_model)


def _shard_cache_key(context, parameters) -> str:
    return "gram-" + stats_key(parameters["plan"], parameters["samples"])


@task(name="gram-statistics", cache_key_fn=_shard_cache_key, persist_result=True, result_serializer="json")
def gram_shard_task(plan: FitPlan, samples: list) -> str:
    """Accumulate one shard's statistics; cached by a hash of the pair, the point, the candidates and the
    shard's token ids (the statistics themselves live in kvlingo's content-addressed store)."""
    shard_stats(plan, samples)
    return stats_key(plan, samples)


@task(name="gram-statistics-ray", cache_policy=NO_CACHE)
def ray_stats_task(plan: FitPlan, shards: list[list]) -> dict[str, int]:
    """Every shard's statistics on Ray actors (tasks/cluster.py); finished shards are skipped (content-addressed
    store). Returns {"shards", "reused", "computed"}."""
    from tasks.fit import ray_shard_stats, stats_stored

    reused = sum(stats_stored(plan, shard) for shard in shards)
    if reused < len(shards):
        ray_shard_stats(plan, shards)
    return {"shards": len(shards), "reused": reused, "computed": len(shards) - reused}


def load_shards(plan: FitPlan, shards: list[list]) -> dict:
    return merge_stats(shard_stats(plan, shard) for shard in shards)


@task(name="closed-form", cache_policy=NO_CACHE)
def closed_form_task(plan: FitPlan, train_shards: list[list], val_shards: list[list]) -> tuple[Any, dict]:
    return solve_closed_form(plan, load_shards(plan, train_shards), load_shards(plan, val_shards))


@task(name="distill", cache_policy=NO_CACHE)
def distill_task(plan: FitPlan, closed_form, summary: dict, lr: float | None = None, seed: int | None = None,
                 cell_dir: Path | None = None) -> tuple[Any, dict]:
    """Stage 2; with workers > 1 this runs Ray Train inside the task."""
    return distill(plan, closed_form, summary, lr=lr, seed=seed, cell_dir=cell_dir)


@task(name="benchmark-suite", cache_policy=NO_CACHE)
def eval_task(config) -> dict:
    from tasks.evaluate import run_eval

    return run_eval(config)


@task(name="multiturn-handoff", cache_policy=NO_CACHE)
def multiturn_task(model_a: str, model_b: str, fit_dir_ab: Path, fit_dir_ba: Path, **options) -> dict:
    from tasks.multiturn import run_multiturn

    return run_multiturn(model_a, model_b, fit_dir_ab=fit_dir_ab, fit_dir_ba=fit_dir_ba, **options)


@task(name="switch-speed", cache_policy=NO_CACHE)
def speed_task(config) -> dict:
    from tasks.bench_speed import run_speed

    return run_speed(config)
