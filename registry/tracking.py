"""MLflow tracking and model registry for kvlingo: where runs go, how a fit is logged, how translators are
registered, promoted and loaded back.

Store: `$MLFLOW_TRACKING_URI` when set, else a local sqlite database `$KVLINGO_HOME/mlflow/mlflow.db` with
artifacts under `$KVLINGO_HOME/mlflow/artifacts/<experiment>` (never `./mlruns` in the working directory).
Nothing is created or configured at import time; every public function calls :func:`use_tracking_store`.

Naming (what the UI, the report and other tools rely on):

- experiment per model pair: `<source>--<target>` ("/" of hub ids replaced by "_"), tagged `kvlingo.kind=pair`;
- fit run tags: `kvlingo.kind=fit`, `source`, `target`, `stage` (closed_form | distilled), `lr` (distilled);
  params: the resolved config, flattened with "." (`a.b`); metrics: `val_kl.<condition>`,
  `val_kl_se.<condition>`, `first_token_kl.<condition>`, `r2.keys`, `r2.values`, and per optimizer step
  `train_kl`, `val_kl`, `learning_rate`;
- benchmark metrics (see :func:`log_benchmark_rows`): `bench.<benchmark>.<condition>.<field>` with field in
  score, se, n, delta, ci_low, ci_high — ci_low/ci_high bound the *paired difference* score − target_native
  on the same items (the `evals.metrics.ScoreRow` convention), delta is that difference's point estimate;
- registered model per pair `<source>--<target>`; version tags `source`, `target`, `stage`, `val_kl`, `point`,
  `kvlingo.pair_sha256` (+ per-role `kvlingo.source_sha256`, `kvlingo.target_sha256`), `kvlingo.val_set_hash`
  (the validation set the `val_kl` was measured on; absent for fits from before data manifests); aliases
  `candidate` (set on every new version) and `champion` (:func:`promote_best`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from infra.settings import apply_offline_defaults, kvlingo_home
from registry.errors import RegistryError, TrackingUnavailableError
from translators.errors import ConfigError, PairMismatchError

ENV_URI = "MLFLOW_TRACKING_URI"
KIND_TAG = "kvlingo.kind"
PAIR_TAG = "kvlingo.pair_sha256"
# The content hash of a fit's held-out validation conversations, on fit runs and on registered versions: a
# validation KL is only comparable with another one measured on the same set.
VAL_SET_TAG = "kvlingo.val_set_hash"
# Where a translator manifest's fit record holds that hash: fit["data_manifest"][VAL_SET_KEY]
# (infra.data_manifest.build_manifest).
VAL_SET_KEY = "val_set_sha256"
STAGES = ("closed_form", "distilled")
BENCH_FIELDS = ("score", "se", "n", "delta", "ci_low", "ci_high")
KL_GROUPS = ("val_kl", "val_kl_se", "val_kl_seed_sd", "first_token_kl")  # seed SD: fits with several --seeds
CONNECT_TIMEOUT_S = 2.0
# MLflow's own limits: params per batch, metrics per batch, characters of a param value.
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _MAX_PARAM_CHARS = 100, 1000, 6000


# ---------------------------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------------------------


def default_tracking_uri() -> str:
    """The platform's own store: a sqlite file under `kvlingo_home()/mlflow` (not created here)."""
    return f"sqlite:///{(kvlingo_home() / 'mlflow' / 'mlflow.db').resolve()}"


def artifact_root() -> Path:
    """Where artifacts of experiments created by kvlingo on a non-server store go (not created here)."""
    return (kvlingo_home() / "mlflow" / "artifacts").resolve()


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI` if set, else :func:`default_tracking_uri`."""
    return os.environ.get(ENV_URI) or default_tracking_uri()


def is_server_uri(uri: str) -> bool:
    """True for an MLflow tracking server (http/https), which chooses its own artifact location."""
    return urlparse(uri).scheme in ("http", "https")


def check_tracking_uri(uri: str, *, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, with a fix, when the store cannot work: a server that does not accept a connection within
    `timeout` seconds, or a sqlite database whose directory is missing or not writable. Other schemes pass.

    Raises:
        TrackingUnavailableError: naming the URI and how to fix it.
    """
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        _check_server(uri, timeout)
    elif scheme == "sqlite":
        _check_sqlite(uri)


def _check_server(uri: str, timeout: float) -> None:
    parsed = urlparse(uri)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        # A TCP connect, not an HTTP request: fast, and independent of proxy settings.
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout):
            pass
    except OSError as err:
        raise TrackingUnavailableError(
            f"the MLflow tracking server {uri} is not reachable ({err}). Start it (`mlflow server` there, or "
            f"`kvlingo ui` for the local store), correct ${ENV_URI}, or unset ${ENV_URI} to log into the local "
            f"store {default_tracking_uri()}"
        ) from err


def _check_sqlite(uri: str) -> None:
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        return
    db = Path(path)
    directory = db.parent if str(db.parent) else Path(".")
    fix = f"create it or make it writable, or point ${ENV_URI} elsewhere"
    if not directory.is_dir():
        raise TrackingUnavailableError(f"the tracking database {uri} cannot be created: {directory} does not exist; {fix}")
    if not os.access(directory, os.W_OK) or (db.exists() and not os.access(db, os.W_OK)):
        raise TrackingUnavailableError(f"the tracking database {uri} is not writable ({directory}); {fix}")


def use_tracking_store() -> str:
    """Point MLflow at the platform's store (creating the default one's directories) and check it.

    Applies the offline/telemetry switches first: MLflow reads them when it is first imported.

    Raises:
        TrackingUnavailableError: see :func:`check_tracking_uri`.
    """
    apply_offline_defaults()
    uri = tracking_uri()
    if uri == default_tracking_uri():
        (kvlingo_home() / "mlflow").mkdir(parents=True, exist_ok=True)
    check_tracking_uri(uri)
    import mlflow

    chosen_by_user = ENV_URI in os.environ
    mlflow.set_tracking_uri(uri)
    if not chosen_by_user:
        # MLflow exports the URI to the environment; left there it would pin every later call in this process
        # to this store even after KVLINGO_HOME changes, as if the user had chosen it.
        os.environ.pop(ENV_URI, None)
    if _sqlite_file(uri) and uri not in _READY_SQLITE_STORES:
        _create_sqlite_tables(uri)
    return uri


# sqlite stores whose tables this process has seen created (the check runs once per process and store).
_READY_SQLITE_STORES: set[str] = set()


def _sqlite_file(uri: str) -> str | None:
    """The database file of a `sqlite:///<path>` URI; None for other URIs and in-memory databases."""
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    return path if path and path != ":memory:" else None


def _create_sqlite_tables(uri: str) -> None:
    """Create (or migrate) the tables of a sqlite store one process at a time.

    MLflow creates them when a process first opens the store; two processes opening a new store at once both
    run the migrations and one fails ("duplicate column name"). A lock beside the database file serialises
    that first opening; later openings find every table and create nothing.
    """
    from mlflow import MlflowClient

    from infra.locks import file_lock

    with file_lock(Path(f"{_sqlite_file(uri)}.lock"), f"creating the tracking store {uri}"):
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # the tracking tables
        client.search_registered_models(max_results=1)  # the model registry's (same database)
    _READY_SQLITE_STORES.add(uri)


def tracking_client():
    """An MlflowClient on the platform's store (see :func:`use_tracking_store`, whose errors it raises)."""
    use_tracking_store()
    from mlflow import MlflowClient

    return MlflowClient()


def pair_name(source: str, target: str) -> str:
    """Experiment and registered-model name of a pair: `<source>--<target>`, "/" of hub ids replaced."""
    return f"{source}--{target}".replace("/", "_")


def kvlingo_experiments(client) -> list:
    """Every live experiment kvlingo created or logged a fit into."""
    return [e for e in client.search_experiments() if e.tags.get(KIND_TAG) == "pair"]


def _ensure_experiment(client, name: str, source: str, target: str) -> str:
    """The id of experiment `name`, created (with a kvlingo artifact location) if missing.

    Raises:
        RegistryError: the experiment exists but was deleted.
    """
    from mlflow.exceptions import MlflowException

    # mlflow.experimentKind: the MLflow 3 UI opens a training experiment on its runs table, not the GenAI
    # traces overview it shows for experiments of unknown kind.
    tags = {KIND_TAG: "pair", "source": source, "target": target, "mlflow.experimentKind": "custom_model_development"}
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = None if is_server_uri(tracking_uri()) else (artifact_root() / name.replace("/", "_")).as_uri()
        try:
            return client.create_experiment(name, artifact_location=location, tags=tags)
        except MlflowException:
            # Another process created it between our lookup and create: use theirs.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise RegistryError(
            f"experiment {name!r} was deleted: restore it (`mlflow experiments restore --experiment-id "
            f"{experiment.experiment_id}`) or log under another experiment name"
        )
    if experiment.tags.get(KIND_TAG) != "pair":
        for key, value in tags.items():
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def _check_run(client, run_id: str, what: str) -> None:
    """Raises RegistryError when `run_id` names no run of this store."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as err:
        raise RegistryError(f"{what} {run_id!r} does not exist in the tracking store {tracking_uri()}: {err.message}") from err


# ---------------------------------------------------------------------------------------------------------------
# Fit runs
# ---------------------------------------------------------------------------------------------------------------


def log_fit_run(
    summary: Mapping[str, Any],
    config: Mapping[str, Any],
    run_dir: str | Path,
    *,
    parent_run_id: str | None = None,
    experiment: str | None = None,
) -> str:
    """Log one fit (`flows.fit.run_fit`'s summary and its output directory) as an MLflow run. Returns its id.

    The run goes into the pair's experiment (or `experiment`), nested under `parent_run_id` when given (a
    sweep). Artifacts: config.yaml, summary.json, r2_per_layer.csv, plots/kl_curve.png (stage 2),
    plots/val_kl_bars.png, plots/assignment.png, and translators/closed_form + translators/distilled from `run_dir` when present.

    Raises:
        ConfigError: a summary without the fields of a fit summary, or a missing run_dir.
        RegistryError: parent_run_id names no run, or the experiment was deleted.
        TrackingUnavailableError: the store cannot be reached or written.
    """
    _check_summary(summary)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist: pass the fit's output directory")
    config = _plain_config(config)
    client = tracking_client()
    source, target = summary["source"], summary["target"]
    experiment_id = _ensure_experiment(client, experiment or pair_name(source, target), source, target)
    tags = fit_tags(summary, config)
    if parent_run_id:
        _check_run(client, parent_run_id, "parent run")
        tags["mlflow.parentRunId"] = parent_run_id
    run_id = client.create_run(experiment_id, run_name=_run_name(summary, config), tags=tags).info.run_id
    try:
        _log_params(client, run_id, flatten(config))
        _log_metrics(client, run_id, fit_metrics(summary))
        _log_fit_artifacts(client, run_id, summary, config, run_dir)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _check_summary(summary: Mapping[str, Any]) -> None:
    """Raises ConfigError listing what a fit summary lacks."""
    if not isinstance(summary, Mapping):
        raise ConfigError(f"a fit summary is a dict (flows.fit.run_fit's result), got {type(summary).__name__}")
    problems = [f"missing {key!r}" for key in ("source", "target", "stage", "val_kl") if key not in summary]
    if "stage" in summary and summary["stage"] not in STAGES:
        problems.append(f"stage is {summary['stage']!r}, expected one of {', '.join(STAGES)}")
    if "val_kl" in summary and not isinstance(summary["val_kl"], Mapping):
        problems.append("val_kl must map condition -> KL")
    if problems:
        raise ConfigError("not a fit summary: " + "; ".join(problems))


def _plain_config(config: Any) -> dict[str, Any]:
    """The resolved config as a JSON-able dict (a pydantic config is dumped)."""
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict or a pydantic config, got {type(config).__name__}")
    return json.loads(json.dumps(dict(config), default=str))


def fit_lr(summary: Mapping[str, Any], config: Mapping[str, Any]) -> float | None:
    """The stage-2 learning rate of a distilled fit; None for a closed-form-only fit."""
    if summary.get("stage") != "distilled":
        return None
    lr = config.get("lr", summary.get("lr"))
    return None if lr is None else float(lr)


def fit_tags(summary: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, str]:
    """Run tags of a fit: kind, pair, stage, lr (distilled only), capture point and assignment method."""
    tags = {KIND_TAG: "fit", "source": str(summary["source"]), "target": str(summary["target"]),
            "stage": str(summary["stage"])}
    lr = fit_lr(summary, config)
    if lr is not None:
        tags["lr"] = repr(lr)
    for key in ("point", "assignment"):
        if config.get(key) is not None:
            tags[key] = str(config[key])
    # What makes runs comparable: the run fingerprint (infra.fingerprint) and the validation set's content hash.
    if summary.get("fingerprint"):
        tags["kvlingo.fingerprint"] = str(summary["fingerprint"])
    manifest = summary.get("data_manifest") or {}
    if manifest.get("val_set_sha256"):
        tags["kvlingo.val_set_hash"] = str(manifest["val_set_sha256"])
        tags["kvlingo.data_manifest"] = str(manifest["manifest_sha256"])
    return tags


def _run_name(summary: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    lr = fit_lr(summary, config)
    return f"fit {summary['stage']}" + (f" lr={lr:g}" if lr is not None else "")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → {"a.b": "value"} with JSON-encoded non-string values (MLflow params are strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        # MLflow rejects longer values; the full config is logged as config.yaml anyway.
        flat[name] = text if len(text) <= _MAX_PARAM_CHARS else text[: _MAX_PARAM_CHARS - 20] + "…(see config.yaml)"
    return flat


def fit_metrics(summary: Mapping[str, Any]) -> list[tuple[str, float, int]]:
    """(key, value, step) of a fit summary: final KLs per condition, mean R², sizes, and the stage-2 history."""
    rows: list[tuple[str, float, int]] = []
    for group in KL_GROUPS:
        rows += [(f"{group}.{name}", v, 0) for name, v in (summary.get(group) or {}).items()]
    rows += [(f"r2.{side}", v, 0) for side, v in (summary.get("r2") or {}).items()]
    rows += [(key, summary[key], 0) for key in ("wall_s", "train_tokens", "n_train", "n_val") if key in summary]
    for record in summary.get("history") or []:
        step = int(record["step"])
        for key, name in (("train_kl", "train_kl"), ("val_kl", "val_kl"), ("lr", "learning_rate")):
            if record.get(key) is not None:
                rows.append((name, record[key], step))
    return [(k, float(v), s) for k, v, s in rows if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + _PARAMS_PER_BATCH])


def _log_metrics(client, run_id: str, metrics: Iterable[tuple[str, float, int]]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, v, now, s) for k, v, s in metrics]
    for i in range(0, len(items), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=items[i : i + _METRICS_PER_BATCH])


def _log_fit_artifacts(client, run_id: str, summary: Mapping[str, Any], config: dict[str, Any], run_dir: Path) -> None:
    import yaml

    from registry import plots

    title = f"{summary['source']} → {summary['target']}"
    with tempfile.TemporaryDirectory(prefix="kvlingo-run-") as tmp:
        out = Path(tmp)
        (out / "plots").mkdir()
        (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        if summary.get("r2_per_layer"):
            (out / "r2_per_layer.csv").write_text(r2_table_csv(summary["r2_per_layer"]))
        plots.kl_curve(summary.get("history") or [], out / "plots" / "kl_curve.png", title=f"stage 2: {title}")
        plots.kl_bars(summary.get("val_kl") or {}, summary.get("val_kl_se") or {}, out / "plots" / "val_kl_bars.png",
                      title=f"validation KL: {title}")
        if summary.get("assignment"):
            plots.assignment_heatmap(summary["assignment"], out / "plots" / "assignment.png", title=f"layer assignment: {title}")
        for record in ("data_manifest.json", "fingerprint.json"):  # the frozen data and the run's fingerprint
            if (run_dir / record).is_file():
                (out / record).write_text((run_dir / record).read_text())
        client.log_artifacts(run_id, str(out))
    for stage in STAGES:
        if (run_dir / stage / "manifest.json").is_file():
            client.log_artifacts(run_id, str(run_dir / stage), artifact_path=f"translators/{stage}")


def r2_table_csv(r2_per_layer: Mapping[str, list[float]]) -> str:
    """CSV `target_layer,keys,values` (one column per cache object) of the held-out R² per target layer."""
    names = list(r2_per_layer)
    columns = [r2_per_layer[name] for name in names]
    lines = ["target_layer," + ",".join(names)]
    for layer in range(max((len(column) for column in columns), default=0)):
        cells = [f"{column[layer]!r}" if layer < len(column) else "" for column in columns]
        lines.append(f"{layer}," + ",".join(cells))
    return "\n".join(lines) + "\n"


def log_benchmark_rows(run_id: str, rows: Iterable[Mapping[str, Any]]) -> int:
    """Log benchmark score rows (`evals.metrics.ScoreRow.to_dict()`) into a run. Returns the metric count.

    Each row becomes metrics `bench.<benchmark>.<condition>.<field>` for the fields in BENCH_FIELDS it holds
    (`delta` is taken from `row["delta"]` or `row["extra"]["delta"]`); the rows also go to `bench/rows.json` and
    their plot (`registry.plots.benchmark_scores`) to `plots/scores.png`.

    Raises:
        ConfigError: a row without benchmark, condition or score, or a condition containing ".".
        RegistryError: the run does not exist.
    """
    rows = [dict(r) for r in rows]
    metrics = []
    for row in rows:
        if any(row.get(k) is None for k in ("benchmark", "condition", "score")):
            raise ConfigError(f"a benchmark row needs benchmark, condition and score, got {sorted(row)}")
        if "." in str(row["condition"]):
            raise ConfigError(f"condition {row['condition']!r}: names with '.' cannot be parsed back from metric keys")
        values = {**{k: row.get(k) for k in BENCH_FIELDS}, "delta": row.get("delta", (row.get("extra") or {}).get("delta"))}
        prefix = f"bench.{row['benchmark']}.{row['condition']}"
        metrics += [(f"{prefix}.{k}", float(v), 0) for k, v in values.items() if v is not None]
    client = tracking_client()
    _check_run(client, run_id, "run")
    _log_metrics(client, run_id, metrics)
    from registry import plots

    with tempfile.TemporaryDirectory(prefix="kvlingo-bench-") as tmp:
        (Path(tmp) / "rows.json").write_text(json.dumps(rows, indent=2, default=str))
        client.log_artifact(run_id, str(Path(tmp) / "rows.json"), artifact_path="bench")
        run = client.get_run(run_id)
        title = f"benchmarks: {run.data.tags.get('source', '?')} → {run.data.tags.get('target', '?')}"
        if plots.benchmark_scores(rows, Path(tmp) / "scores.png", title=title):
            client.log_artifact(run_id, str(Path(tmp) / "scores.png"), artifact_path="plots")
    return len(metrics)


# ---------------------------------------------------------------------------------------------------------------
# Registered translators
# ---------------------------------------------------------------------------------------------------------------


def signature_sha256(signature: Any) -> str:
    """A stable fingerprint of a model signature (or of a whole pair)."""
    return hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()


def version_tags(manifest: Mapping[str, Any]) -> dict[str, str]:
    """Model-version tags of a translator artifact: pair names and fingerprints, stage, point, validation KL."""
    pair = manifest["pair"]
    fit = manifest.get("fit") or {}
    tags = {
        "source": str(pair["source"].get("name")),
        "target": str(pair["target"].get("name")),
        "stage": str(fit.get("stage")),
        "point": str(manifest.get("point")),
        PAIR_TAG: signature_sha256(pair),
        "kvlingo.source_sha256": signature_sha256(pair["source"]),
        "kvlingo.target_sha256": signature_sha256(pair["target"]),
        "kvlingo.weights_sha256": str(manifest.get("weights_sha256")),
    }
    val_kl = (fit.get("val_kl") or {}).get(fit.get("stage"))
    if isinstance(val_kl, (int, float)) and math.isfinite(val_kl):
        tags["val_kl"] = repr(float(val_kl))
    val_set = manifest_val_set_hash(fit)
    if val_set is not None:
        tags[VAL_SET_TAG] = val_set
    return tags


def manifest_val_set_hash(fit: Mapping[str, Any]) -> str | None:
    """The validation-set hash of a translator manifest's fit record; None for a fit without a data manifest
    (fitted before data manifests existed).

    Raises:
        ArtifactError: the fit record has a data manifest without the validation-set hash.
    """
    data_manifest = fit.get("data_manifest")
    if data_manifest is None:
        return None
    if not data_manifest.get(VAL_SET_KEY):
        from translators.artifact import ArtifactError

        raise ArtifactError(f"the translator manifest's fit.data_manifest has no {VAL_SET_KEY!r}: cannot tell which "
                            "validation set its val_kl was measured on; re-save the artifact from its fit")
    return str(data_manifest[VAL_SET_KEY])


def check_model_name(name: str) -> None:
    """Raises ConfigError for a registered-model name that `models:/` URIs or filters cannot carry."""
    bad = [c for c in "/@'\"" if c in name]
    if not name.strip() or bad:
        raise ConfigError(f"registered model name {name!r} must be non-empty without {' '.join(bad) or 'blanks only'}")


def _versions(client, name: str) -> list:
    return client.search_model_versions(f"name = '{name}'")


def check_registered_pair(client, name: str, tags: Mapping[str, str], what: str) -> None:
    """Refuse to add a translator between other models to registered model `name`.

    Versions of one registered model translate between the same *named* models. A new revision or build of
    those models is a new version, not another model: every version carries its exact pair signature, loading
    checks it against the models at hand, and `promote_best` only ranks versions of the newest signature
    (and validation set).

    Raises:
        PairMismatchError: an existing version is for other model names, or has no kvlingo pair signature.
    """
    new_pair = f"{tags['source']} → {tags['target']}"
    for version in _versions(client, name):
        existing = version.tags
        if PAIR_TAG not in existing:
            raise PairMismatchError(
                f"registered model {name!r} version {version.version} has no kvlingo pair signature (registered "
                f"outside kvlingo), so {what} ({new_pair}) cannot be added to it; register under another name"
            )
        if (existing.get("source"), existing.get("target")) != (tags["source"], tags["target"]):
            raise PairMismatchError(
                f"registered model {name!r} holds translators for {existing.get('source')} → {existing.get('target')} "
                f"(version {version.version}), but {what} is for {new_pair}. Versions of one registered model "
                f"translate between the same models: register it under {pair_name(tags['source'], tags['target'])!r} "
                "(the default name) or another new name"
            )


def _pip_requirements() -> list[str]:
    """Pinned to this environment, so MLflow does not load the model in a subprocess to infer them."""
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in ("mlflow", "torch", "safetensors")]


def log_translator_model(artifact_dir: str | Path, registered_name: str | None = None, *, run_id: str | None = None) -> str:
    """Log a translator artifact as an MLflow pyfunc model and register it; the new version gets the
    `candidate` alias. Returns `models:/<name>/<version>`.

    The registered name defaults to `<source>--<target>`. The pair check runs before anything is verified,
    logged or registered. The model is logged into `run_id` (e.g. the fit run) or a new `register` run in
    the pair's experiment.

    Raises:
        ArtifactError: not a translator artifact, weights that do not match the manifest's sha256, or a data
            manifest without its validation-set hash.
        ConfigError: a name that `models:/` URIs cannot carry.
        PairMismatchError: `registered_name` already holds versions of another model pair (both named).
        RegistryError: run_id names no run.
    """
    from translators.artifact import load_translator, read_manifest

    artifact_dir = Path(artifact_dir)
    manifest = read_manifest(artifact_dir)
    tags = version_tags(manifest)
    name = registered_name or pair_name(tags["source"], tags["target"])
    check_model_name(name)
    client = tracking_client()
    check_registered_pair(client, name, tags, f"the artifact {artifact_dir}")
    load_translator(artifact_dir)  # verify the weights' sha256 before anything is logged
    model_uri = _log_pyfunc(client, artifact_dir, tags, run_id)
    import mlflow

    version = mlflow.register_model(model_uri, name, tags=tags)
    client.set_registered_model_alias(name, "candidate", version.version)
    return f"models:/{name}/{version.version}"


def _log_pyfunc(client, artifact_dir: Path, tags: Mapping[str, str], run_id: str | None) -> str:
    import mlflow

    from registry.pyfunc_model import ARTIFACT_KEY, TranslatorModel

    active = mlflow.active_run()
    if run_id:
        _check_run(client, run_id, "run")
        run = contextlib.nullcontext() if active and active.info.run_id == run_id else mlflow.start_run(run_id=run_id, nested=active is not None)
    else:
        experiment_id = _ensure_experiment(client, pair_name(tags["source"], tags["target"]), tags["source"], tags["target"])
        run_tags = {KIND_TAG: "register", **{k: tags[k] for k in ("source", "target", "stage")}}
        run = mlflow.start_run(experiment_id=experiment_id, run_name=f"register {tags['stage']}", tags=run_tags,
                               nested=active is not None)
    with run, _quiet_pickle_advice():
        info = mlflow.pyfunc.log_model(
            name=f"translator_{tags['stage']}",
            python_model=TranslatorModel(),
            artifacts={ARTIFACT_KEY: str(artifact_dir)},
            pip_requirements=_pip_requirements(),
        )
    return info.model_uri


@contextlib.contextmanager
def _quiet_pickle_advice():
    """Drop MLflow's advice against pickled python models while we log one: our pickle holds only a class
    reference and an empty state (`registry.pyfunc_model`), the weights travel as safetensors."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passing a Python object as `python_model`")

    logger = logging.getLogger("mlflow.pyfunc")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def promote_best(name: str) -> dict[str, Any]:
    """Make the version with the lowest `val_kl` tag the `champion`; ties go to the newer version.

    Only versions comparable with the newest version compete: those for its exact model pair (translators
    fitted for older revisions or builds of the models cannot serve the current ones) and whose validation KL
    was measured on its validation set (`kvlingo.val_set_hash`; a KL on other conversations is another
    measurement). Versions without a validation-set hash (fits from before data manifests) only compete with
    each other.

    Returns:
        {"name", "version", "val_kl", "val_set_hash"} of the champion (val_set_hash None when untagged).
    Raises:
        RegistryError: no version of `name`, or none comparable with the newest carries a validation KL.
    """
    from mlflow.exceptions import MlflowException

    from infra.locks import named_lock

    client = tracking_client()
    # Two fits of one pair finishing together (sweep cells) both promote. The lock makes choose-then-set atomic
    # between processes on this KVLINGO_HOME, so a promoter with an older view of the versions cannot overwrite
    # a newer choice. Processes on other machines writing to one tracking server can still collide in the
    # store's insert of the alias row (sqlite: "UNIQUE constraint failed: registered_model_aliases"); the loser
    # re-reads the versions and sets the alias again.
    with named_lock(f"promote-{name}", f"promoting the champion of {name}"):
        failures = 0
        while True:
            champion = _choose_champion(client, name)
            try:
                client.set_registered_model_alias(name, "champion", str(champion["version"]))
                return champion
            except MlflowException:
                failures += 1
                if failures == 3:
                    raise
                time.sleep(0.2 * failures)


def _choose_champion(client, name: str) -> dict[str, Any]:
    """:func:`promote_best`'s choice, without setting the alias (same return value and errors)."""
    versions = _versions(client, name)
    if not versions:
        raise RegistryError(f"no registered model {name!r} (or it has no versions): register one with `log_translator_model`")
    newest = max(versions, key=lambda v: int(v.version))
    basis = _comparison_basis(newest)
    scored = [(value, -int(v.version)) for v in versions
              if _comparison_basis(v) == basis and (value := _val_kl_tag(v)) is not None]
    if not scored:
        raise RegistryError(
            f"registered model {name!r} has no version with a val_kl tag for its newest model pair and validation set "
            f"(version {newest.version}): register translators with `log_translator_model` (it tags the validation "
            "KL and the validation set from the manifest)"
        )
    value, negative_version = min(scored)
    return {"name": name, "version": -negative_version, "val_kl": value, "val_set_hash": basis[1]}


def _comparison_basis(version) -> tuple[str | None, str | None]:
    """What makes two versions' validation KLs comparable: (pair signature, validation-set hash)."""
    return version.tags.get(PAIR_TAG), version.tags.get(VAL_SET_TAG)


def _val_kl_tag(version) -> float | None:
    """The version's finite `val_kl` tag, or None when it has none (or an unreadable one)."""
    try:
        value = float(version.tags["val_kl"])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------------------------
# Loading back
# ---------------------------------------------------------------------------------------------------------------


def load_translator_uri(
    uri: str | Path, source_sig: dict[str, Any] | None = None, target_sig: dict[str, Any] | None = None
):
    """Load a translator from `models:/<name>@<alias>`, `models:/<name>/<version>`, `runs:/<id>/<path>` (a
    logged model or a translator directory logged with a run) or a local artifact/model directory.

    The weights' sha256 is verified and, when signatures are given, the pair (`translators.artifact`).

    Returns:
        (Translator, manifest)
    Raises:
        RegistryError: the URI names nothing in the store, or holds no translator artifact.
        ArtifactError, PairMismatchError: from `translators.artifact.load_translator`.
    """
    from translators.artifact import load_translator

    local = Path(uri).expanduser()
    if "://" not in str(uri) and not str(uri).startswith(("models:", "runs:")):
        if not local.is_dir():
            raise RegistryError(f"{uri} is neither a directory nor a models:/ or runs:/ URI")
        return load_translator(translator_dir(local), source=source_sig, target=target_sig)
    with tempfile.TemporaryDirectory(prefix="kvlingo-model-") as tmp:
        downloaded = _download(str(uri), tmp)
        return load_translator(translator_dir(downloaded), source=source_sig, target=target_sig)


def fetch_translator(uri: str, destination: str | Path) -> Path:
    """Download the translator a `models:/` or `runs:/` URI names into `destination` (kept) and return its
    artifact directory, for processes that cannot import MLflow (the vLLM connector).

    Raises:
        RegistryError: the URI names nothing in the store, or holds no translator artifact.
    """
    Path(destination).mkdir(parents=True, exist_ok=True)
    return translator_dir(_download(str(uri), str(destination)))


def _download(uri: str, destination: str) -> Path:
    use_tracking_store()  # first: it sets the offline switches MLflow reads on import
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=destination))
    except MlflowException as err:
        raise RegistryError(
            f"cannot fetch {uri} from {tracking_uri()}: {err.message.rstrip('.')}. List models and aliases with `kvlingo ui` "
            "(Models page) or check the run id"
        ) from err


def translator_dir(path: Path) -> Path:
    """The translator artifact directory inside a downloaded path: itself, the pyfunc model's attached
    artifact, or the single directory below holding a manifest.

    Raises:
        RegistryError: no (or more than one) translator artifact below `path`.
    """
    from registry.pyfunc_model import ARTIFACT_KEY

    if (path / "manifest.json").is_file():
        return path
    if (path / "MLmodel").is_file():
        apply_offline_defaults()  # MLflow reads the telemetry switch on import
        from mlflow.models import Model

        artifacts = Model.load(str(path)).flavors.get("python_function", {}).get("artifacts", {})
        if ARTIFACT_KEY in artifacts:
            return path / artifacts[ARTIFACT_KEY]["path"]
    found = sorted(p.parent for p in path.rglob("manifest.json"))
    if len(found) != 1:
        raise RegistryError(
            f"{path} holds {len(found)} translator artifacts ({', '.join(str(p) for p in found) or 'none'}): "
            "point at one translator (e.g. runs:/<id>/translators/distilled)"
        )
    return found[0]
