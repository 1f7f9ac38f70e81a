"""Prefect flows: fit (tracked), sweep, benchmark, speed, demo.

They run locally with no server (Prefect starts a temporary local API) or on a Prefect server / work pool
through `prefect.yaml`. Every fit logs an MLflow run (one experiment per pair) and registers its translator;
sweep cells are nested under the sweep's run and are skipped when already trained and logged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefect import flow

from translators.errors import ConfigError
from infra.config import FitConfig
from infra.fingerprint import fingerprint
from tasks.evaluate import EvalConfig
from tasks.prefect_tasks import closed_form_task, distill_task, eval_task, gram_shard_task, plan_task
from tasks.track import finished_cell_task, log_run_task, register_task


def start_local_prefect_api() -> None:
    """Start Prefect's temporary local API now, one kvlingo process at a time; a no-op when a Prefect server is
    configured (PREFECT_API_URL). Call before running a flow.

    Processes on one KVLINGO_HOME share the sqlite database in PREFECT_HOME: temporary servers starting at the
    same moment both migrate it, and one fails its start-up with a traceback (Prefect then retries on another
    port). A flow started afterwards uses the server started here.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    from infra.locks import named_lock

    with named_lock("prefect-api", "the start of Prefect's temporary API"):
        SubprocessASGIServer().start()


def _shards(samples: list, n: int) -> list[list]:
    """Contiguous shards; statistics of disjoint shards sum exactly to the one-pass statistics."""
    size = math.ceil(len(samples) / n)
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def _stage1(config: FitConfig, n_shards: int):
    """Plan, Gram statistics and closed form, one process at a time per model pair: concurrent sweeps or
    tracked fits of a pair share the run directory (config.yaml, fingerprint.json, closed_form/) and the
    statistics store, so the second waits, then reuses the first's statistics."""
    from infra.locks import named_lock

    with named_lock(f"stage1-{config.source}--{config.target}", f"stage 1 of {config.source} → {config.target}"):
        return _stage1_unlocked(config, n_shards)


def _stage1_unlocked(config: FitConfig, n_shards: int):
    plan = plan_task(config)
    if plan.hybrid:
        raise ConfigError(f"{config.source} → {config.target} has a hybrid side: the tracked flow (--track) does not "
                          "fit hybrid caches yet; run `kvlingo fit` without --track (artifacts in its run directory)")
    from tasks.cluster import use_ray

    if use_ray(config.workers, config.ray_address):
        # On Ray: the content-addressed 32-sample shards of `kvlingo fit`, computed on actors that hold the pair
        # (tasks/cluster.py), stored here; closed_form_task then reads and merges them in shard order.
        from tasks.fit import shard_samples
        from tasks.prefect_tasks import ray_stats_task

        train_shards, val_shards = shard_samples(plan.stats_train), shard_samples(plan.val)
        ray_stats_task(plan, train_shards + val_shards)
        translator, summary = closed_form_task(plan, train_shards, val_shards)
        return plan, translator, summary
    train_shards, val_shards = _shards(plan.stats_train, n_shards), _shards(plan.val, 1)
    futures = [gram_shard_task.submit(plan, shard) for shard in train_shards + val_shards]
    for future in futures:
        future.result()  # raises the shard's error, if any
    translator, summary = closed_form_task(plan, train_shards, val_shards)
    return plan, translator, summary


def _benchmarks(config: FitConfig, fit_dir: Path, eval_limit: int, data_dir: Path | None, ruler_lengths: list[int]) -> list[dict]:
    """The fit's benchmarks, read from the registry (evals/benchmarks/): the data-free suite, or with a data
    folder the quick suite (the data-free benchmarks plus the local-file ones)."""
    from evals.benchmarks import default_suite

    eval_config = EvalConfig(
        source=config.source, target=config.target, suite=default_suite(data_dir), fit_dir=fit_dir, limit=eval_limit,
        data_dir=data_dir, ruler_lengths=ruler_lengths, workers=config.workers, ray_address=config.ray_address,
    )
    return eval_task(eval_config)["rows"]


@flow(name="kvlingo-fit")
def fit_flow(
    config: FitConfig,
    *,
    n_shards: int = 2,
    evaluate: bool = True,
    eval_limit: int = 6,
    data_dir: Path | None = None,
    ruler_lengths: list[int] | None = None,
    register_translator: bool = True,
) -> dict[str, Any]:
    """Pair → samples → Gram statistics fanned out per shard (cached) → assignment → closed form → distillation
    (Ray when workers > 1) → benchmark suite → MLflow run → registered translator."""
    plan, translator, summary = _stage1(config, n_shards)
    if not config.stage1_only:
        translator, summary = distill_task(plan, translator, summary)
    rows = _benchmarks(config, plan.out, eval_limit, data_dir, ruler_lengths or [256, 512]) if evaluate else []
    run_id = log_run_task(summary, config.model_dump(mode="json"), bench_rows=rows)
    result = {**summary, "run_id": run_id, "benchmarks": rows}
    if register_translator:
        result["registry"] = register_task(summary["artifact"], run_id)
    return result


@flow(name="kvlingo-sweep")
def sweep_flow(
    pairs: list[tuple[str, str]],
    *,
    both_directions: bool = True,
    centre_lr: float = 1e-3,  # kvlingo fit's default lr
    n_rates: int = 5,
    seeds: list[int] | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """App. E: per (pair, direction) five rates half a decade apart around `centre_lr`, extended while the best is
    on an edge, selected by final validation KL; the remaining seeds then train at the chosen rate. Stage 1 and
    finished cells are reused on a re-run. Sweeps running at once on one KVLINGO_HOME take turns per cell (a
    file lock held from the look-up to the registration): each cell trains once, the other sweep reads it."""
    from infra.locks import named_lock
    from registry.tracking import pair_name, tracking_client, use_tracking_store
    from tasks.cluster import release_workers, use_ray
    from tasks.fit import distill_on_ray
    from translators.lr_selection import initial_rates, select_learning_rate

    seeds = seeds or [0]
    use_tracking_store()
    client = tracking_client()
    directions = [(s, t) for s, t in pairs] + ([(t, s) for s, t in pairs] if both_directions else [])
    results: dict[str, Any] = {}
    for source, target in directions:
        config = FitConfig(source=source, target=target, **(base or {}))
        on_ray = use_ray(config.workers, config.ray_address)
        plan, closed_form, summary = _stage1(config, n_shards=2)
        experiment = client.get_experiment_by_name(pair_name(source, target))
        parent = client.create_run(experiment.experiment_id if experiment else _experiment_id(client, source, target),
                                   run_name="sweep", tags={"kvlingo.kind": "sweep", "source": source, "target": target})
        trained: list[str] = []

        def cell(lr: float, seed: int) -> float:
            # The cell's full run fingerprint: config (with this lr and seed), exact model pair, data manifest.
            key = fingerprint(plan.stage2_fields(config.model_copy(update={"lr": lr, "seed": seed})))
            # Held from the look-up to the registration: a concurrent sweep waits, then finds the logged cell.
            with named_lock(f"cell-{key}", f"sweep cell lr={lr:.3g} seed={seed} of {source} → {target}"):
                found = finished_cell_task(key, pair_name(source, target))
                if found and found["val_kl"] is not None:
                    return found["val_kl"]
                cell_dir = plan.out / "sweep" / f"lr_{lr:.3g}_seed_{seed}"
                if on_ray:  # on an idle actor of the pair, beside the other cells
                    _, cell_summary = distill_on_ray(plan, closed_form, summary, lr=lr, seed=seed, cell_dir=cell_dir)
                else:
                    _, cell_summary = distill_task(plan, closed_form, summary, lr=lr, seed=seed, cell_dir=cell_dir)
                run_id = log_run_task(cell_summary, config.model_copy(update={"lr": lr, "seed": seed}).model_dump(mode="json"),
                                      parent_run_id=parent.info.run_id, tags={"kvlingo.cell": key})
                trained.append(run_id)
                register_task(cell_summary["artifact"], run_id)
                return cell_summary["val_kl"]["distilled"]

        if on_ray:
            # Independent cells at once, one per actor: the initial window of rates, then the other seeds. A window
            # extension is one rate and waits for the window's results (App. E), as in one process.
            window = _concurrently(cell, [(lr, seeds[0]) for lr in initial_rates(centre_lr, n_rates)], config.workers)
            selected, by_rate = select_learning_rate(
                lambda lr: window[(lr, seeds[0])] if (lr, seeds[0]) in window else cell(lr, seeds[0]), centre_lr, n=n_rates)
            seed_kl = {seed: kl for (_, seed), kl in
                       _concurrently(cell, [(selected, seed) for seed in seeds[1:]], config.workers).items()}
            release_workers()  # the next direction is another pair of models
        else:
            selected, by_rate = select_learning_rate(lambda lr: cell(lr, seeds[0]), centre_lr, n=n_rates)
            seed_kl = {seed: cell(selected, seed) for seed in seeds[1:]}
        client.set_terminated(parent.info.run_id)
        results[pair_name(source, target)] = {
            "selected_lr": selected, "val_kl_by_lr": {f"{lr:.3g}": kl for lr, kl in sorted(by_rate.items())},
            "other_seeds": seed_kl, "trained_runs": trained,
        }
    return results


def _concurrently(cell, cells: list[tuple[float, int]], workers: int) -> dict[tuple[float, int], float]:
    """{(lr, seed): cell(lr, seed)} with up to `workers` cells in flight (threads of this flow, each waiting on a
    Ray actor; each thread runs in a copy of the flow's context, so the cells' Prefect tasks belong to this flow
    run). Raises the first failed cell's error after every cell has finished."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    if len(cells) < 2:
        return {c: cell(*c) for c in cells}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(cells))), thread_name_prefix="kvlingo-cell") as pool:
        futures = {c: pool.submit(contextvars.copy_context().run, cell, *c) for c in cells}
        return {c: f.result() for c, f in futures.items()}


def _experiment_id(client, source: str, target: str) -> str:
    from registry.tracking import _ensure_experiment, pair_name

    return _ensure_experiment(client, pair_name(source, target), source, target)


@flow(name="kvlingo-benchmark")
def benchmark_flow(config: EvalConfig) -> dict[str, Any]:
    """A (registered) translator on a benchmark suite; rows logged to a new MLflow run of the pair."""
    from registry.tracking import log_benchmark_rows, pair_name, tracking_client, use_tracking_store

    result = eval_task(config)
    use_tracking_store()
    client = tracking_client()
    run = client.create_run(_experiment_id(client, result["source"], result["target"]), run_name=f"benchmark {config.suite_name()}",
                            tags={"kvlingo.kind": "benchmark", "source": result["source"], "target": result["target"],
                                  "translators": ",".join(config.translators)})
    log_benchmark_rows(run.info.run_id, result["rows"])
    client.set_terminated(run.info.run_id)
    return {**result, "run_id": run.info.run_id, "experiment": pair_name(result["source"], result["target"])}


DEMO_PAIR = ("kvlingo-tiny-l", "kvlingo-tiny-s")
DEMO_EVAL_LIMIT = 60  # items per benchmark: enough that the recall CIs separate translated from empty prefix
DEMO_SPEED_LENGTHS = [256, 1024]
DEMO_HANDOFF = {"n_conversations": 8, "turns": 8}


def _fit_side_by_side(configs: list[FitConfig], *, eval_limit: int, data_dir: Path | None) -> list[dict[str, Any]]:
    """`fit_flow` of each config (benchmarks included) at once, each in a process of its own with an equal share of
    the cores; results in the order of `configs`.

    Why processes: the embedded pair's steps are too small for two threads to share one model's work. Measured on
    2 cores, stage 2 of tiny-l → tiny-s took 3:53 min alone with 2 threads, and 2:20 with one thread while the other
    direction ran beside it on the other core. Each process reports to this process's Prefect API (one temporary
    server, not one per process) and to the same MLflow store; its progress bars print when they finish instead of
    redrawing over the other's (TTY_INTERACTIVE=0).
    """
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // len(configs))
    env = {"TTY_INTERACTIVE": "0", "OMP_NUM_THREADS": str(threads), **_prefect_api_of_this_process()}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # spawned processes copy this environment when they start
    try:
        with ProcessPoolExecutor(len(configs), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_fit_in_own_process, config.model_dump(mode="json"), threads, eval_limit, data_dir)
                       for config in configs]
            return [future.result() for future in futures]  # re-raises a process's error here
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _prefect_api_of_this_process() -> dict[str, str]:
    """PREFECT_API_URL of the temporary server `start_local_prefect_api` started here ({} when one is configured:
    child processes inherit that setting)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return {}
    from prefect.server.api.server import SubprocessASGIServer

    return {"PREFECT_API_URL": SubprocessASGIServer().api_url}


def _fit_in_own_process(config: dict[str, Any], threads: int, eval_limit: int, data_dir: Path | None) -> dict[str, Any]:
    """One direction of the demo in a spawned process (see `_fit_side_by_side`)."""
    import torch

    torch.set_num_threads(threads)
    return fit_flow(FitConfig.model_validate(config), eval_limit=eval_limit, data_dir=data_dir, ruler_lengths=[128, 256])


@flow(name="kvlingo-demo")
def demo_flow(steps: int | None = None, eval_limit: int = DEMO_EVAL_LIMIT, data_dir: Path | None = None,
              html: Path | None = None) -> dict[str, Any]:
    """The README's main job: the embedded pair in both directions with `kvlingo fit`'s default recipe (`steps`
    overrides stage 2's length, for quick checks), tracked and registered; then the multi-turn hand-off between
    the two distilled translators, the switch speed at two prefix lengths, the DuckDB summary and the report page
    (`html`, default $KVLINGO_HOME/report.html)."""
    from infra.config import SpeedBenchConfig
    from infra.settings import kvlingo_home
    from registry.report import refresh_duckdb, report_rows
    from tasks.prefect_tasks import multiturn_task, speed_task
    from tasks.track import log_result_task, report_page_task

    quick = {} if steps is None else {"steps": steps, "eval_every": max(1, steps // 3), "checkpoint_every": max(1, steps // 3)}
    configs = [FitConfig(source=source, target=target, **quick) for source, target in (DEMO_PAIR, DEMO_PAIR[::-1])]
    fits = _fit_side_by_side(configs, eval_limit=eval_limit, data_dir=data_dir)
    handoff = multiturn_task(*DEMO_PAIR, Path(fits[0]["run_dir"]), Path(fits[1]["run_dir"]), **DEMO_HANDOFF)
    log_result_task("multiturn", handoff)
    speed = []
    for fit in fits:
        result = speed_task(SpeedBenchConfig(source=fit["source"], target=fit["target"], lengths=DEMO_SPEED_LENGTHS,
                                             translator=str(Path(fit["run_dir"]) / fit["stage"])))
        log_result_task("speed", result)
        speed.append(result)
    db = refresh_duckdb()
    page = report_page_task(Path(html) if html else kvlingo_home() / "report.html")
    return {"fits": fits, "multiturn": handoff, "speed": speed, "report": report_rows(db), "duckdb": str(db),
            "html": page}
