"""`kvlingo fit` in one process: plan → Gram statistics shard by shard → closed form → stage 2 per seed.

Composition only: the units of work live in tasks/fit.py, shared with the tracked Prefect flow.
"""

from __future__ import annotations

import json
import time
from typing import Any

from infra.config import FitConfig
from tasks.fit import STATS_SHARD_SIZE, distill_seeds, plan_fit, progress_bars, sharded_stats, solve_closed_form
from tasks.stats_store import store_root


def run_fit(config: FitConfig) -> dict[str, Any]:
    """The whole fit in this process: stage 1, then stage 2 unless `stage1_only`. Returns the JSON summary."""
    plan = plan_fit(config)
    if plan.hybrid:
        from tasks.hybrid_fit import fit_hybrid

        summary = fit_hybrid(plan)
        summary["wall_s"] = round(time.perf_counter() - plan.started, 2)
        (plan.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    with progress_bars() as progress:
        # Shard by shard: a fit killed here and re-run recomputes only the shard that was in progress.
        stats, train_shards = sharded_stats(plan, plan.stats_train, progress, "stage 1: train statistics")
        val_stats, val_shards = sharded_stats(plan, plan.val, progress, "stage 1: held-out statistics")
        reused = train_shards["reused"] + val_shards["reused"]
        if reused:
            progress.console.print(f"stage 1: reused {reused} finished statistics shard(s) from {store_root()}; "
                                   "`kvlingo stats-store` shows and prunes it")
    translator, summary = solve_closed_form(plan, stats, val_stats)
    summary["stats_shards"] = {"train": train_shards, "val": val_shards, "shard_size": STATS_SHARD_SIZE}
    if not config.stage1_only:
        summary = distill_seeds(plan, translator, summary)
    summary["wall_s"] = round(time.perf_counter() - plan.started, 2)
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
