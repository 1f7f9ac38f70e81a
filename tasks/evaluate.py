"""Prefect task running the benchmark suite (thin call into flows.evaluate)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="benchmark-suite", cache_policy=NO_CACHE)
def eval_task(config) -> dict:
    from flows.evaluate import run_eval

    return run_eval(config)
