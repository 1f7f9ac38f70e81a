"""Multi-turn hand-off and switch-speed results as MLflow runs, beside the pair's fit runs.

- `kvlingo.kind=multiturn` in the experiment of (model A, model B): metrics `multiturn.<mode>.recall` per turn
  (step = turn, from 1) and `multiturn.<mode>.mean`; artifacts `multiturn.json` (the `tasks.multiturn` result)
  and `plots/multiturn.png`.
- `kvlingo.kind=speed` in the experiment of (source, target): metrics `speed.<n>.<field>` per prefix length n for
  the timed fields; artifact `speed.json` (the `tasks.bench_speed` result).

`latest_result` reads the newest such run's JSON back (the report page uses it).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from registry.tracking import KIND_TAG, _ensure_experiment, _log_metrics, pair_name, tracking_client
from translators.errors import ConfigError

RESULT_FILES = {"multiturn": "multiturn.json", "speed": "speed.json"}
SPEED_FIELDS = ("switch_s", "prefill_s", "ratio", "flop_ratio", "switch_peak_mb", "prefill_peak_mb")


def log_multiturn_run(result: Mapping[str, Any]) -> str:
    """Log a `tasks.multiturn.run_multiturn` result. Returns the run id.

    Raises:
        ConfigError: a result without model_a, model_b or modes.
        TrackingUnavailableError: the store cannot be reached or written.
    """
    _require(result, ("model_a", "model_b", "modes"), "a multi-turn result (tasks.multiturn.run_multiturn)")
    metrics = []
    for mode, row in result["modes"].items():
        metrics += [(f"multiturn.{mode}.recall", float(v), turn) for turn, v in enumerate(row["per_turn"], start=1)]
        metrics.append((f"multiturn.{mode}.mean", float(row["mean"]), 0))

    def extra(out: Path) -> None:
        from registry import plots

        (out / "plots").mkdir()
        plots.multiturn_per_turn(result["modes"], out / "plots" / "multiturn.png",
                                 title=f"hand-off {result['model_a']} ⇄ {result['model_b']}")

    return _log_result_run("multiturn", result["model_a"], result["model_b"], result, metrics, extra)


def log_speed_run(result: Mapping[str, Any]) -> str:
    """Log a `tasks.bench_speed.run_speed` result. Returns the run id.

    Raises:
        ConfigError: a result without source, target or rows.
        TrackingUnavailableError: the store cannot be reached or written.
    """
    _require(result, ("source", "target", "rows"), "a speed result (tasks.bench_speed.run_speed)")
    metrics = [(f"speed.{row['n']}.{field}", float(row[field]), 0)
               for row in result["rows"] for field in SPEED_FIELDS if row.get(field) is not None]
    return _log_result_run("speed", result["source"], result["target"], result, metrics, None)


def latest_result(kind: str, source: str, target: str) -> dict[str, Any] | None:
    """The JSON result of the newest finished `kind` run ("multiturn" or "speed") of the pair, or None.

    Raises:
        ConfigError: an unknown kind.
        TrackingUnavailableError: the store cannot be reached.
    """
    if kind not in RESULT_FILES:
        raise ConfigError(f"unknown result kind {kind!r}: one of {', '.join(RESULT_FILES)}")
    client = tracking_client()
    experiment = client.get_experiment_by_name(pair_name(source, target))
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{KIND_TAG}` = '{kind}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    with tempfile.TemporaryDirectory(prefix="kvlingo-result-") as tmp:
        path = client.download_artifacts(runs[0].info.run_id, RESULT_FILES[kind], tmp)
        return {**json.loads(Path(path).read_text()), "run_id": runs[0].info.run_id}


def _require(result: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in result] if isinstance(result, Mapping) else list(keys)
    if missing:
        raise ConfigError(f"not {what}: missing {', '.join(missing)}")


def _log_result_run(kind: str, source: str, target: str, result: Mapping[str, Any], metrics: list, extra) -> str:
    """One finished run of `kind` holding `metrics`, the result as JSON and whatever `extra(out_dir)` writes."""
    client = tracking_client()
    experiment_id = _ensure_experiment(client, pair_name(source, target), source, target)
    run_id = client.create_run(experiment_id, run_name=kind,
                               tags={KIND_TAG: kind, "source": source, "target": target}).info.run_id
    try:
        _log_metrics(client, run_id, metrics)
        with tempfile.TemporaryDirectory(prefix=f"kvlingo-{kind}-") as tmp:
            out = Path(tmp)
            (out / RESULT_FILES[kind]).write_text(json.dumps(result, indent=2, default=str))
            if extra is not None:
                extra(out)
            client.log_artifacts(run_id, str(out))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id
