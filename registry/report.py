"""DuckDB summaries of the runs logged in MLflow.

`refresh_duckdb` reads every kvlingo experiment with `mlflow.search_runs` and rewrites a DuckDB file
(default `$KVLINGO_HOME/kvlingo.duckdb`) holding:

- table `runs`: one row per fit run *and stage* — a fit logs both its closed-form and (with stage 2) its
  distilled translator, so a distilled fit gives two rows. Columns: run_id, experiment, source, target,
  direction ("a → b"), pair (the two names sorted, "a <-> b"), stage, val_kl (the seed mean for a fit with several
  seeds), val_kl_se (standard error over validation items), val_kl_seed_sd (SD over seeds, App. E.1), first_token_kl,
  empty_prefix_kl, random_map_kl, r2_keys, r2_values, lr (distilled rows only), point, assignment,
  val_set_hash (tag `kvlingo.val_set_hash`: the validation set val_kl was measured on; null for runs logged
  before data manifests), parent_run_id, status, start_time;
- table `bench`: one row per run × benchmark × condition from metrics
  `bench.<benchmark>.<condition>.<field>` (see `registry.tracking.log_benchmark_rows`);
- view `best_translators`: per direction (source, target) and validation set (val_set_hash) the row with the
  lowest validation KL. A validation KL on other conversations is another measurement, so runs are ranked only
  against runs sharing their validation set; untagged runs (val_set_hash null) form a group of their own;
- view `lr_sweep`: per direction, validation set and learning rate, the best and mean final validation KL of
  distilled rows (sweep cells of several seeds), the SD over those seeds beside the mean item SE, with `is_best` marking the selected rate within the direction and validation set;
- view `bench_deltas`: per run, benchmark and non-native condition, the difference to `target_native` with a
  confidence interval: the logged paired-bootstrap CI when present (`ci_method = 'paired_bootstrap'`), else a
  normal approximation from both standard errors that ignores pairing (`'normal_unpaired'`, conservative).
  Empty when no run logged benchmark metrics.

The file is written beside and then moved into place, so a reader never sees a half-written summary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.settings import kvlingo_home
from registry.errors import RegistryError
from registry.tracking import BENCH_FIELDS, KIND_TAG, STAGES, VAL_SET_TAG, kvlingo_experiments, tracking_client

TABLES = ("runs", "bench")
VIEWS = ("best_translators", "lr_sweep", "bench_deltas")
CONTRACT_KEYS = ("source", "target", "stage", "val_kl", "lr", "run_id")
BEST_KEYS = CONTRACT_KEYS + ("val_set_hash",)
RANKING_NOTE = ("best translators are ranked within runs sharing a validation set (val_set_hash); runs without "
                "one (logged before data manifests) are ranked among themselves")

_RUNS_DDL = """
CREATE TABLE runs (
    run_id VARCHAR, experiment VARCHAR, source VARCHAR, target VARCHAR, direction VARCHAR, pair VARCHAR,
    stage VARCHAR, val_kl DOUBLE, val_kl_se DOUBLE, val_kl_seed_sd DOUBLE, first_token_kl DOUBLE, empty_prefix_kl DOUBLE,
    random_map_kl DOUBLE, r2_keys DOUBLE, r2_values DOUBLE, lr DOUBLE, point VARCHAR, assignment VARCHAR,
    val_set_hash VARCHAR, parent_run_id VARCHAR, status VARCHAR, start_time TIMESTAMPTZ
)"""
_BENCH_DDL = """
CREATE TABLE bench (
    run_id VARCHAR, source VARCHAR, target VARCHAR, benchmark VARCHAR, condition VARCHAR,
    score DOUBLE, se DOUBLE, n DOUBLE, delta DOUBLE, ci_low DOUBLE, ci_high DOUBLE
)"""
_VIEWS_SQL = (
    """CREATE VIEW best_translators AS
    SELECT * FROM runs WHERE val_kl IS NOT NULL
    QUALIFY row_number() OVER (PARTITION BY source, target, val_set_hash ORDER BY val_kl, start_time DESC) = 1""",
    """CREATE VIEW lr_sweep AS
    SELECT source, target, val_set_hash, lr, min(val_kl) AS val_kl, avg(val_kl) AS mean_val_kl,
           stddev_samp(val_kl) AS seed_sd_val_kl, avg(val_kl_se) AS mean_item_se, count(*) AS n_runs,
           arg_min(run_id, val_kl) AS best_run_id,
           min(val_kl) = min(min(val_kl)) OVER (PARTITION BY source, target, val_set_hash) AS is_best
    FROM runs WHERE stage = 'distilled' AND lr IS NOT NULL AND val_kl IS NOT NULL
    GROUP BY source, target, val_set_hash, lr""",
    """CREATE VIEW bench_deltas AS
    SELECT b.run_id, b.source, b.target, b.benchmark, b.condition, b.score, b.se,
           t.score AS native_score, t.se AS native_se,
           coalesce(b.delta, b.score - t.score) AS delta,
           CASE WHEN b.ci_low IS NOT NULL THEN b.ci_low
                ELSE b.score - t.score - 1.96 * sqrt(pow(coalesce(b.se, 0), 2) + pow(coalesce(t.se, 0), 2)) END AS ci_low,
           CASE WHEN b.ci_high IS NOT NULL THEN b.ci_high
                ELSE b.score - t.score + 1.96 * sqrt(pow(coalesce(b.se, 0), 2) + pow(coalesce(t.se, 0), 2)) END AS ci_high,
           CASE WHEN b.ci_low IS NOT NULL THEN 'paired_bootstrap' ELSE 'normal_unpaired' END AS ci_method
    FROM bench b JOIN bench t
      ON t.run_id = b.run_id AND t.benchmark = b.benchmark AND t.condition = 'target_native'
    WHERE b.condition <> 'target_native'""",
)


def default_db_path() -> Path:
    """`kvlingo_home()/kvlingo.duckdb` (not created here)."""
    return kvlingo_home() / "kvlingo.duckdb"


# ---------------------------------------------------------------------------------------------------------------
# From MLflow to rows
# ---------------------------------------------------------------------------------------------------------------


def search_fit_runs():
    """`mlflow.search_runs` over every kvlingo experiment, fit runs only (a pandas DataFrame, maybe empty),
    plus {experiment_id: name}.

    Raises:
        TrackingUnavailableError: the store cannot be reached or written.
    """
    client = tracking_client()  # first: it sets the offline switches MLflow reads on import
    import mlflow
    import pandas as pd

    experiments = {e.experiment_id: e.name for e in kvlingo_experiments(client)}
    if not experiments:
        return pd.DataFrame(), experiments
    frame = mlflow.search_runs(experiment_ids=list(experiments), output_format="pandas")
    column = f"tags.{KIND_TAG}"
    if frame.empty or column not in frame:
        return pd.DataFrame(), experiments
    return frame[frame[column] == "fit"].reset_index(drop=True), experiments


def _number(value: Any) -> float | None:
    """A finite float, or None for missing/NaN/unparseable values (DataFrame cells, tag strings)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def stage_rows(record: Mapping[str, Any], experiment: str | None) -> list[dict[str, Any]]:
    """The `runs` rows of one search_runs record: one per stage whose `val_kl.<stage>` was logged."""
    source, target = record.get("tags.source"), record.get("tags.target")
    lr = _number(record.get("tags.lr")) or _number(record.get("params.lr"))
    rows = []
    for stage in STAGES:
        val_kl = _number(record.get(f"metrics.val_kl.{stage}"))
        if val_kl is None:
            continue
        rows.append({
            "run_id": record["run_id"], "experiment": experiment, "source": source, "target": target,
            "direction": f"{source} → {target}", "pair": " <-> ".join(sorted([str(source), str(target)])),
            "stage": stage, "val_kl": val_kl,
            "val_kl_se": _number(record.get(f"metrics.val_kl_se.{stage}")),
            "val_kl_seed_sd": _number(record.get(f"metrics.val_kl_seed_sd.{stage}")),
            "first_token_kl": _number(record.get(f"metrics.first_token_kl.{stage}")),
            "empty_prefix_kl": _number(record.get("metrics.val_kl.empty_prefix")),
            "random_map_kl": _number(record.get("metrics.val_kl.random_map")),
            "r2_keys": _number(record.get("metrics.r2.keys")), "r2_values": _number(record.get("metrics.r2.values")),
            # The closed-form solve has no learning rate; only the distilled row carries the run's lr.
            "lr": lr if stage == "distilled" else None,
            "point": _text(record.get("tags.point")), "assignment": _text(record.get("tags.assignment")),
            "val_set_hash": _text(record.get(f"tags.{VAL_SET_TAG}")),
            "parent_run_id": _text(record.get("tags.mlflow.parentRunId")),
            "status": record.get("status"), "start_time": record.get("start_time"),
        })
    return rows


def bench_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `bench` rows of one search_runs record, parsed from `metrics.bench.<benchmark>.<condition>.<field>`
    (the benchmark name may contain dots; condition and field cannot)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in record.items():
        if not key.startswith("metrics.bench."):
            continue
        parts = key[len("metrics.bench."):].split(".")
        if len(parts) < 3 or parts[-1] not in BENCH_FIELDS or _number(value) is None:
            continue
        benchmark, condition, field = ".".join(parts[:-2]), parts[-2], parts[-1]
        row = found.setdefault((benchmark, condition), {
            "run_id": record["run_id"], "source": record.get("tags.source"), "target": record.get("tags.target"),
            "benchmark": benchmark, "condition": condition, **{f: None for f in BENCH_FIELDS},
        })
        row[field] = _number(value)
    return [row for row in found.values() if row["score"] is not None]


def collect_tables() -> dict[str, list[dict[str, Any]]]:
    """{"runs": [...], "bench": [...]} rows from the tracking store, runs sorted by direction and start."""
    frame, experiments = search_fit_runs()
    runs: list[dict[str, Any]] = []
    bench: list[dict[str, Any]] = []
    for record in frame.to_dict("records"):
        runs += stage_rows(record, experiments.get(record.get("experiment_id")))
        bench += bench_rows(record)
    runs.sort(key=lambda r: (str(r["source"]), str(r["target"]), str(r["start_time"]), STAGES.index(r["stage"])))
    return {"runs": runs, "bench": bench}


# ---------------------------------------------------------------------------------------------------------------
# DuckDB
# ---------------------------------------------------------------------------------------------------------------


def refresh_duckdb(db_path: str | Path | None = None) -> Path:
    """Rewrite the DuckDB summary from the tracking store. Returns its path.

    Raises:
        TrackingUnavailableError: the store cannot be reached or written.
        RegistryError: the DuckDB file cannot be written (another process holds it, or no permission).
    """
    import duckdb
    import pandas as pd

    path = Path(db_path) if db_path else default_db_path()
    tables = collect_tables()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        with duckdb.connect(str(partial)) as con:
            con.execute(_RUNS_DDL)
            con.execute(_BENCH_DDL)
            for name, rows in tables.items():
                if rows:
                    frame = pd.DataFrame(rows)
                    con.register("incoming", frame)
                    con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM incoming")
                    con.unregister("incoming")
            for sql in _VIEWS_SQL:
                con.execute(sql)
        os.replace(partial, path)
    except (duckdb.Error, OSError) as err:
        partial.unlink(missing_ok=True)
        raise RegistryError(f"cannot write the DuckDB summary {path}: {err}. Close other programs using it "
                            "or pass another path") from err
    return path


def _query(db_path: Path, sql: str) -> list[dict[str, Any]]:
    import duckdb

    if not Path(db_path).is_file():
        raise RegistryError(f"no DuckDB summary at {db_path}: run `kvlingo report` first")
    with duckdb.connect(str(db_path), read_only=True) as con:
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]


def read_table(db_path: str | Path, name: str) -> list[dict[str, Any]]:
    """All rows of one table or view of a summary file.

    Raises:
        RegistryError: unknown table name or no file.
    """
    if name not in TABLES + VIEWS:
        raise RegistryError(f"unknown summary table {name!r}; choose one of {', '.join(TABLES + VIEWS)}")
    order = {"runs": "source, target, start_time, stage", "lr_sweep": "source, target, val_set_hash, lr",
             "best_translators": "source, target, val_set_hash", "bench": "run_id, benchmark, condition",
             "bench_deltas": "run_id, benchmark, condition"}[name]
    return _query(Path(db_path), f"SELECT * FROM {name} ORDER BY {order}")


def report_rows(db_path: str | Path | None = None) -> list[dict[str, Any]]:
    """The public JSON rows `{source, target, stage, val_kl, lr, run_id}`, one per fit run and stage.

    Read from the DuckDB summary when `db_path` is given, else straight from the tracking store.

    Raises:
        TrackingUnavailableError, RegistryError: see :func:`refresh_duckdb` and :func:`read_table`.
    """
    rows = read_table(db_path, "runs") if db_path else collect_tables()["runs"]
    return [{k: (_number(row[k]) if k in ("val_kl", "lr") else row[k]) for k in CONTRACT_KEYS} for row in rows]


def best_translator_rows(db_path: str | Path) -> list[dict[str, Any]]:
    """The best translator per direction and validation set, as JSON rows `{source, target, stage, val_kl, lr,
    run_id, val_set_hash}` (see RANKING_NOTE).

    Raises:
        RegistryError: no summary file.
    """
    rows = read_table(db_path, "best_translators")
    return [{k: (_number(row[k]) if k in ("val_kl", "lr") else row[k]) for k in BEST_KEYS} for row in rows]


def json_rows(db_path: str | Path, name: str) -> list[dict[str, Any]]:
    """All rows of one table or view (`read_table`) with JSON-safe values: floats finite or None (NaN, e.g. the
    SD of a single seed, becomes None), bools, ints and strings as they are, anything else as text.

    Raises:
        RegistryError: unknown table name or no file.
    """
    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return _number(value)
        return str(value)

    return [{k: plain(v) for k, v in row.items()} for row in read_table(db_path, name)]


def report_json(db_path: str | Path) -> dict[str, Any]:
    """`kvlingo report --json`: {"runs": report_rows, "best_translators": best_translator_rows,
    "best_translators_ranking": RANKING_NOTE, "lr_sweep": rows of the `lr_sweep` view, "bench_deltas": rows of
    the `bench_deltas` view} (the views' columns are described in the module docstring; `json_rows`).

    Raises:
        RegistryError: no summary file.
    """
    return {"runs": report_rows(db_path), "best_translators": best_translator_rows(db_path),
            "best_translators_ranking": RANKING_NOTE, "lr_sweep": json_rows(db_path, "lr_sweep"),
            "bench_deltas": json_rows(db_path, "bench_deltas")}


def export_parquet(db_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write every table and view of a summary as `<out_dir>/<name>.parquet`. Returns the files.

    Raises:
        RegistryError: no summary file, or the directory cannot be written.
    """
    import duckdb

    db_path, out_dir = Path(db_path), Path(out_dir)
    if not db_path.is_file():
        raise RegistryError(f"no DuckDB summary at {db_path}: run `kvlingo report` first")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        with duckdb.connect(str(db_path), read_only=True) as con:
            for name in TABLES + VIEWS:
                target = out_dir / f"{name}.parquet"
                # COPY takes no bound parameters for its path; quote it as an SQL string literal.
                con.execute(f"COPY (SELECT * FROM {name}) TO '{str(target).replace(chr(39), chr(39) * 2)}' (FORMAT parquet)")
                written.append(target)
    except (duckdb.Error, OSError) as err:
        raise RegistryError(f"cannot export parquet files into {out_dir}: {err}") from err
    return written


def short_direction(source: str, target: str) -> str:
    """"a → b" without the first name segment both share (up to "-" or "/"): `kvlingo-tiny-l`, `kvlingo-tiny-s`
    → "tiny-l → tiny-s", `Qwen/Qwen3-0.6B`, `Qwen/Qwen3-1.7B` → "Qwen3-0.6B → Qwen3-1.7B"; otherwise the whole names."""
    source, target = str(source), str(target)
    cut = next((i + 1 for i, c in enumerate(source) if c in "-/"), 0)
    if not cut or source[:cut] != target[:cut] or cut == len(source) or cut == len(target):
        cut = 0
    return f"{source[cut:]} → {target[cut:]}"


def _by_direction(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["source"], row["target"]), []).append(row)
    return groups


def print_report(db_path: str | Path, console=None) -> None:
    """Rich tables of a summary file, one per direction so that rows fit a 100-column terminal: runs, best
    translator per validation set (followed by RANKING_NOTE), learning-rate sweep, benchmark deltas.

    Raises:
        RegistryError: no summary file.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    runs = read_table(db_path, "runs")
    if not runs:
        from registry.tracking import tracking_uri

        console.print(f"no fit runs logged in the tracking store {tracking_uri()} yet")
        return
    best = _by_direction(read_table(db_path, "best_translators"))
    sweep = _by_direction(read_table(db_path, "lr_sweep"))
    deltas = _by_direction(read_table(db_path, "bench_deltas"))
    for (source, target), rows in _by_direction(runs).items():
        direction = short_direction(source, target)
        table = Table("stage", "val KL", "± item se", "± seed SD", "lr", "val set", "run",
                      title=f"{source} → {target}: runs (validation KL, nats/token)")
        for r in rows:
            table.add_row(r["stage"], _fmt(r["val_kl"]), _fmt(r["val_kl_se"]), _fmt(r["val_kl_seed_sd"]),
                          _fmt(r["lr"], ".1e"), _hash(r["val_set_hash"]), r["run_id"][:8])
        console.print(table)
        table = Table("val set", "stage", "val KL", "lr", "run", title=f"best translator {direction}")
        for r in best.get((source, target), []):
            table.add_row(_hash(r["val_set_hash"]), r["stage"], _fmt(r["val_kl"]), _fmt(r["lr"], ".1e"), r["run_id"][:8])
        console.print(table)
        if sweep.get((source, target)):
            table = Table("val set", "lr", "best val KL", "mean", "± seed SD", "± item se", "runs", "selected",
                          title=f"learning-rate sweep {direction} (mean over seeds)")
            for r in sweep[(source, target)]:
                table.add_row(_hash(r["val_set_hash"]), _fmt(r["lr"], ".1e"), _fmt(r["val_kl"]), _fmt(r["mean_val_kl"]),
                              _fmt(r["seed_sd_val_kl"]), _fmt(r["mean_item_se"]), str(r["n_runs"]), "✓" if r["is_best"] else "")
            console.print(table)
        if deltas.get((source, target)):
            table = Table("benchmark", "condition", "score", "Δ vs target", "95% CI", "CI", title=f"benchmarks {direction}",
                          caption="CI: paired bootstrap, or normal (unpaired, conservative)")
            for r in deltas[(source, target)]:
                table.add_row(r["benchmark"], r["condition"], _fmt(r["score"]), _fmt(r["delta"], "+.4f"),
                              f"[{_fmt(r['ci_low'], '+.4f')}, {_fmt(r['ci_high'], '+.4f')}]",
                              "paired" if r["ci_method"] == "paired_bootstrap" else "normal")
            console.print(table)
    console.print(RANKING_NOTE, style="dim")


def _hash(value: str | None) -> str:
    """A validation-set hash shortened for a table cell; "—" for runs without one."""
    return "—" if value is None else value[:12]


def _fmt(value: Any, spec: str = ".4f") -> str:
    number = _number(value)
    return "—" if number is None else format(number, spec)
