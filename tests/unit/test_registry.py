"""MLflow tracking, model registry and DuckDB summaries against a throwaway sqlite store."""

import json
import os
import pickle
import shutil
import socket
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch

from registry.errors import RegistryError, TrackingUnavailableError
from registry.report import RANKING_NOTE, export_parquet, read_table, refresh_duckdb, report_json, report_rows
from registry.tracking import (
    check_tracking_uri,
    default_tracking_uri,
    load_translator_uri,
    log_benchmark_rows,
    log_fit_run,
    log_translator_model,
    promote_best,
    tracking_uri,
    use_tracking_store,
)
from translators.artifact import save_translator
from translators.errors import ConfigError, PairMismatchError
from translators.translator import Translator

SRC = {"name": "a", "identity": {"gguf_sha256": "1" * 64}, "config_sha256": "c1", "tokenizer_sha256": "t", "layout": {"n_layers": 3}}
TGT = {"name": "b", "identity": {"gguf_sha256": "2" * 64}, "config_sha256": "c2", "tokenizer_sha256": "t", "layout": {"n_layers": 2}}
ASSIGNMENT = {"keys": {0: (0, 1), 1: (2, 1)}, "values": {0: (0, 2), 1: (1, 2)}}
KL = {"closed_form": 0.40, "empty_prefix": 2.5, "random_map": 9.0, "distilled": 0.25}


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory):
    """An empty MLflow sqlite database, migrated once (≈10 s) and copied into each test's store."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(kvlingo_home, monkeypatch, migrated_db):
    """The platform's default store in a fresh KVLINGO_HOME (MLFLOW_TRACKING_URI unset)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (kvlingo_home / "mlflow").mkdir(parents=True)
    shutil.copy(migrated_db, kvlingo_home / "mlflow" / "mlflow.db")
    use_tracking_store()  # point MLflow's globals here before a test touches MlflowClient directly
    yield kvlingo_home
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


def make_translator(seed: int) -> Translator:
    tr = Translator(ASSIGNMENT, d_src=4, d_tgt=6, point="pre_norm")
    g = torch.Generator().manual_seed(seed)
    for p in tr.maps.values():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return tr


def fake_fit(tmp_path, *, source=SRC, target=TGT, lr=3e-3, distilled_kl=0.25, val_set=None):
    """A fit output directory (closed_form/, distilled/, config.yaml, summary.json) and its summary.

    val_set: the validation-set hash recorded in the translators' data manifest (None: a fit from before data
    manifests, without one).
    """
    out = tmp_path / f"run-{source['name']}-{target['name']}-{lr}-{val_set}"
    kl = {**KL, "distilled": distilled_kl}
    data = {} if val_set is None else {"data_manifest": {"val_set_sha256": val_set}}
    save_translator(make_translator(0), out / "closed_form", source=source, target=target,
                    fit={"stage": "closed_form", "val_kl": {k: v for k, v in kl.items() if k != "distilled"}, **data})
    save_translator(make_translator(1), out / "distilled", source=source, target=target,
                    fit={"stage": "distilled", "val_kl": kl, "steps": 4, **data})
    history = [{"step": s, "train_kl": 1.0 / s, "lr": lr * s / 4} for s in range(1, 5)]
    history[1]["val_kl"], history[3]["val_kl"] = 0.3, distilled_kl
    summary = {
        "source": source["name"], "target": target["name"], "stage": "distilled",
        "val_kl": kl, "val_kl_se": {k: 0.01 for k in kl}, "first_token_kl": {k: v / 2 for k, v in kl.items()},
        "r2": {"keys": 0.8, "values": 0.6}, "r2_per_layer": {"keys": [0.7, 0.9], "values": [0.5, 0.7]},
        "assignment": {side: {str(t): list(s) for t, s in ASSIGNMENT[side].items()} for side in ASSIGNMENT},
        "history": history, "steps": 4, "artifact": str(out / "distilled"),
    }
    config = {"source": source["name"], "target": target["name"], "lr": lr, "steps": 4, "point": "pre_norm",
              "assignment": "r2", "output_dir": None}
    (out / "summary.json").write_text(json.dumps(summary))
    return summary, config, out


def test_default_uri_is_a_sqlite_file_under_kvlingo_home_and_nothing_is_created(kvlingo_home, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == f"sqlite:///{(kvlingo_home / 'mlflow' / 'mlflow.db').resolve()}"
    assert not kvlingo_home.exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri() == "http://tracking.example:5000"
    assert default_tracking_uri().startswith("sqlite:///")


def test_unreachable_server_fails_fast_with_the_uri_and_a_fix(store, tmp_path, monkeypatch):
    with socket.socket() as sock:  # a loopback port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    summary, config, out = fake_fit(tmp_path)
    started = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match=rf"{uri} is not reachable.*unset \$MLFLOW_TRACKING_URI"):
        log_fit_run(summary, config, out)
    # Loose bound: catches MLflow's minutes-long HTTP retry loop, not a speed goal.
    assert time.monotonic() - started < 10


def test_sqlite_store_in_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(TrackingUnavailableError, match="does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path}/missing/mlflow.db")
    check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")  # an existing writable directory passes


def test_log_fit_run_logs_params_metrics_history_tags_and_artifacts(store, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    summary, config, out = fake_fit(tmp_path)
    parent = MlflowClient().create_run(MlflowClient().create_experiment("sweep")).info.run_id
    run_id = log_fit_run(summary, config, out, parent_run_id=parent)

    frame = mlflow.search_runs(experiment_names=["a--b"])
    row = frame.set_index("run_id").loc[run_id]
    assert row["params.lr"] == "0.003" and row["params.point"] == "pre_norm" and row["params.output_dir"] == "null"
    assert row["metrics.val_kl.closed_form"] == pytest.approx(0.40)
    assert row["metrics.val_kl.distilled"] == pytest.approx(0.25)
    assert row["metrics.val_kl_se.random_map"] == pytest.approx(0.01)
    assert row["metrics.r2.keys"] == pytest.approx(0.8) and row["metrics.r2.values"] == pytest.approx(0.6)
    assert (row["tags.source"], row["tags.target"], row["tags.stage"], row["tags.lr"]) == ("a", "b", "distilled", "0.003")
    assert row["tags.mlflow.parentRunId"] == parent and row["status"] == "FINISHED"

    client = MlflowClient()
    train = client.get_metric_history(run_id, "train_kl")
    assert [(m.step, m.value) for m in sorted(train, key=lambda m: m.step)] == [(s, 1.0 / s) for s in range(1, 5)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val_kl")) == [(2, 0.3), (4, 0.25)]

    local = client.download_artifacts(run_id, "", str(tmp_path / "dl"))
    files = {p.relative_to(local).as_posix() for p in Path(local).rglob("*") if p.is_file()}
    assert {"config.yaml", "summary.json", "r2_per_layer.csv", "plots/kl_curve.png", "plots/assignment.png",
            "translators/closed_form/manifest.json", "translators/distilled/weights.safetensors"} <= files
    csv = (Path(local) / "r2_per_layer.csv").read_text().splitlines()
    assert csv == ["target_layer,keys,values", "0,0.7,0.5", "1,0.9,0.7"]
    assert (Path(local) / "plots" / "assignment.png").read_bytes()[:4] == b"\x89PNG"


def test_log_fit_run_rejects_a_non_summary_and_a_missing_parent(store, tmp_path):
    summary, config, out = fake_fit(tmp_path)
    with pytest.raises(ConfigError, match="missing 'val_kl'"):
        log_fit_run({k: v for k, v in summary.items() if k != "val_kl"}, config, out)
    with pytest.raises(RegistryError, match="parent run 'nope' does not exist"):
        log_fit_run(summary, config, out, parent_run_id="nope")


def test_register_alias_promote_and_load_back_bit_identical(store, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    summary, config, out = fake_fit(tmp_path)
    run_id = log_fit_run(summary, config, out)
    assert log_translator_model(out / "closed_form", run_id=run_id) == "models:/a--b/1"
    assert log_translator_model(out / "distilled") == "models:/a--b/2"
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("a--b", "candidate").version) == "2"
    assert client.get_model_version("a--b", "1").tags["val_kl"] == repr(0.40)

    assert promote_best("a--b") == {"name": "a--b", "version": 2, "val_kl": 0.25, "val_set_hash": None}

    expected = make_translator(1)
    loaded, manifest = load_translator_uri("models:/a--b@champion", source_sig=SRC, target_sig=TGT)
    assert manifest["fit"]["stage"] == "distilled"
    for name, weight in expected.maps.items():
        assert torch.equal(loaded.maps[name], weight)
    from_run, _ = load_translator_uri(f"runs:/{run_id}/translators/closed_form")
    assert all(torch.equal(from_run.maps[n], w) for n, w in make_translator(0).maps.items())
    with pytest.raises(PairMismatchError, match="source.name"):
        load_translator_uri("models:/a--b/1", source_sig={**SRC, "name": "z"})
    with pytest.raises(RegistryError, match="cannot fetch models:/a--b@nope"):
        load_translator_uri("models:/a--b@nope")

    # The pyfunc model works on its own and pickles no tensor: the weights travel as safetensors.
    model = mlflow.pyfunc.load_model("models:/a--b/2")
    assert model.predict(None)["val_kl"]["distilled"] == 0.25
    keys = [np.random.default_rng(s).standard_normal((3, 4)).astype(np.float32) for s in range(3)]
    out_maps = model.predict({"keys": keys, "values": keys})
    want_keys, _ = expected([torch.from_numpy(k) for k in keys], [torch.from_numpy(k) for k in keys])
    np.testing.assert_array_equal(out_maps["keys"][1], want_keys[1].detach().numpy())
    model_dir = Path(mlflow.artifacts.download_artifacts("models:/a--b/2", dst_path=str(tmp_path / "m")))
    pickled = (model_dir / "python_model.pkl").read_bytes()
    assert b"_rebuild_tensor" not in pickled and b"torch" not in pickled
    assert pickle.loads(pickled)._translator is None


def test_registering_another_pair_under_a_name_is_refused_before_any_logging(store, tmp_path):
    from mlflow import MlflowClient

    summary, config, out = fake_fit(tmp_path)
    log_translator_model(out / "distilled")
    other_src, other_tgt = {**SRC, "name": "c"}, {**TGT, "name": "d"}
    _, _, other = fake_fit(tmp_path, source=other_src, target=other_tgt)
    client = MlflowClient()
    runs_before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    with pytest.raises(PairMismatchError, match=r"a → b.*c → d.*same models: register it under 'c--d'"):
        log_translator_model(other / "distilled", registered_name="a--b")
    assert [str(v.version) for v in client.search_model_versions("name = 'a--b'")] == ["1"]
    assert client.get_experiment_by_name("c--d") is None
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == runs_before


def test_a_rebuilt_model_gives_a_new_version_and_only_the_newest_pair_competes(store, tmp_path):
    _, _, old = fake_fit(tmp_path, distilled_kl=0.05)
    assert log_translator_model(old / "distilled") == "models:/a--b/1"
    rebuilt = {**SRC, "identity": {"gguf_sha256": "9" * 64}}  # same name, other weights
    _, _, new = fake_fit(tmp_path, source=rebuilt, lr=1e-2, distilled_kl=0.3)
    assert log_translator_model(new / "distilled") == "models:/a--b/2"
    # Version 1 has the lower KL but cannot serve the rebuilt model, so it does not compete.
    assert promote_best("a--b") == {"name": "a--b", "version": 2, "val_kl": 0.3, "val_set_hash": None}
    _, manifest = load_translator_uri("models:/a--b@champion", source_sig=rebuilt, target_sig=TGT)
    assert manifest["pair"]["source"]["identity"] == rebuilt["identity"]
    with pytest.raises(PairMismatchError, match=r"source\.identity"):
        load_translator_uri("models:/a--b/1", source_sig=rebuilt, target_sig=TGT)


def test_only_versions_on_the_newest_validation_set_compete(store, tmp_path):
    from mlflow import MlflowClient

    # Version 1 has the lowest KL, but on another validation set; version 2 predates data manifests.
    _, _, other_set = fake_fit(tmp_path, distilled_kl=0.05, val_set="aaa")
    _, _, untagged = fake_fit(tmp_path, distilled_kl=0.10)
    _, _, worse = fake_fit(tmp_path, lr=1e-2, distilled_kl=0.30, val_set="bbb")
    _, _, better = fake_fit(tmp_path, lr=1e-3, distilled_kl=0.20, val_set="bbb")
    for out in (other_set, untagged, better, worse):
        log_translator_model(out / "distilled")
    assert MlflowClient().get_model_version("a--b", "1").tags["kvlingo.val_set_hash"] == "aaa"
    assert "kvlingo.val_set_hash" not in MlflowClient().get_model_version("a--b", "2").tags
    # Versions 3 (0.20) and 4 (0.30, the newest) share validation set "bbb": 3 is the champion.
    assert promote_best("a--b") == {"name": "a--b", "version": 3, "val_kl": 0.20, "val_set_hash": "bbb"}
    assert str(MlflowClient().get_model_version_by_alias("a--b", "champion").version) == "3"
    # A newest version without a validation-set hash competes only with other untagged versions.
    _, _, untagged_newer = fake_fit(tmp_path, lr=5e-3, distilled_kl=0.15)
    log_translator_model(untagged_newer / "distilled")
    assert promote_best("a--b") == {"name": "a--b", "version": 2, "val_kl": 0.10, "val_set_hash": None}


def test_promotions_racing_on_one_store_leave_the_best_version_champion(store, tmp_path, monkeypatch):
    """Sweep cells finishing together promote at once. A conflict on the alias row (the store's UNIQUE
    constraint, as seen when two sweep cells inserted it together) is retried on a fresh read of the versions."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    for lr, kl in ((1e-3, 0.30), (2e-3, 0.20), (3e-3, 0.25)):
        _, _, out = fake_fit(tmp_path, lr=lr, distilled_kl=kl)
        log_translator_model(out / "distilled")
    real_set = MlflowClient.set_registered_model_alias
    conflicts = []

    def first_call_conflicts(self, name, alias, version):
        if not conflicts:
            conflicts.append(version)
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases.name")
        return real_set(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", first_call_conflicts)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: promote_best("a--b"), range(4)))
    assert conflicts == ["2"]
    assert results == [{"name": "a--b", "version": 2, "val_kl": 0.20, "val_set_hash": None}] * 4
    assert str(MlflowClient().get_model_version_by_alias("a--b", "champion").version) == "2"


def test_a_store_that_keeps_refusing_the_alias_raises_after_three_tries(store, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    _, _, out = fake_fit(tmp_path)
    log_translator_model(out / "distilled")
    calls = []

    def always_conflicts(self, name, alias, version):
        calls.append(version)
        raise MlflowException("UNIQUE constraint failed: registered_model_aliases.name")

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", always_conflicts)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    with pytest.raises(MlflowException, match="UNIQUE constraint"):
        promote_best("a--b")
    assert calls == ["1"] * 3


def test_a_data_manifest_without_its_validation_set_hash_is_refused(store, tmp_path):
    from translators.artifact import ArtifactError

    out = tmp_path / "no-hash"
    save_translator(make_translator(1), out, source=SRC, target=TGT,
                    fit={"stage": "distilled", "val_kl": KL, "data_manifest": {"train_set_sha256": "t"}})
    with pytest.raises(ArtifactError, match="val_set_sha256"):
        log_translator_model(out)


def test_best_translator_is_ranked_within_a_validation_set(store, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app
    from mlflow import MlflowClient

    runs = {}
    for key, lr, kl, val_set in (("other", 1e-3, 0.05, "aaa"), ("old", 2e-3, 0.08, None),
                                 ("best", 3e-3, 0.20, "bbb"), ("worse", 1e-2, 0.30, "bbb")):
        summary, config, out = fake_fit(tmp_path, lr=lr, distilled_kl=kl)
        runs[key] = log_fit_run(summary, config, out)
        if val_set is not None:
            MlflowClient().set_tag(runs[key], "kvlingo.val_set_hash", val_set)
    db = refresh_duckdb()
    best = read_table(db, "best_translators")
    # One best per validation set: run "other" (0.05) never outranks the runs on set "bbb", nor the untagged run.
    assert [(b["val_set_hash"], b["run_id"], b["stage"], b["val_kl"]) for b in best] == [
        ("aaa", runs["other"], "distilled", 0.05), ("bbb", runs["best"], "distilled", 0.20),
        (None, runs["old"], "distilled", 0.08)]
    sweep = read_table(db, "lr_sweep")
    assert [(s["val_set_hash"], s["lr"], s["is_best"]) for s in sweep] == [
        ("aaa", 1e-3, True), ("bbb", 3e-3, True), ("bbb", 1e-2, False), (None, 2e-3, True)]

    runner = CliRunner()
    result = runner.invoke(app, ["report", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["best_translators_ranking"] == RANKING_NOTE and "ranked within runs sharing a validation set" in RANKING_NOTE
    assert [(b["val_set_hash"], b["run_id"], b["val_kl"]) for b in out["best_translators"]] == [
        ("aaa", runs["other"], 0.05), ("bbb", runs["best"], 0.20), (None, runs["old"], 0.08)]
    result = runner.invoke(app, ["report"])
    assert result.exit_code == 0 and RANKING_NOTE in " ".join(result.stdout.split()) and "val set" in result.stdout


def test_report_rows_duckdb_views_and_parquet(store, tmp_path):
    runs = {}
    for lr, kl in ((1e-3, 0.30), (3e-3, 0.25), (1e-2, 0.35)):
        summary, config, out = fake_fit(tmp_path, lr=lr, distilled_kl=kl)
        runs[lr] = log_fit_run(summary, config, out)
    summary, config, out = fake_fit(tmp_path, lr=5.0)
    closed_only = {k: v for k, v in summary.items() if k != "history"} | {"stage": "closed_form"}
    closed_only["val_kl"] = {k: v for k, v in summary["val_kl"].items() if k != "distilled"}
    runs["closed"] = log_fit_run(closed_only, {**config, "stage1_only": True}, out)
    log_benchmark_rows(runs[3e-3], [
        {"benchmark": "arc", "condition": "target_native", "score": 0.60, "se": 0.02, "n": 100},
        {"benchmark": "arc", "condition": "translated", "score": 0.55, "se": 0.02, "n": 100,
         "ci_low": -0.08, "ci_high": -0.02, "extra": {"delta": -0.05}},
        {"benchmark": "arc", "condition": "source_native", "score": 0.50, "se": 0.03, "n": 100},
    ])

    rows = report_rows()
    assert all(set(r) == {"source", "target", "stage", "val_kl", "lr", "run_id"} for r in rows)
    by_run = {(r["run_id"], r["stage"]): r for r in rows}
    assert len(rows) == 7  # three distilled fits × two stages + one closed-form-only fit
    assert by_run[(runs[3e-3], "distilled")]["lr"] == 3e-3 and by_run[(runs[3e-3], "distilled")]["val_kl"] == 0.25
    assert by_run[(runs[3e-3], "closed_form")]["lr"] is None and by_run[(runs[3e-3], "closed_form")]["val_kl"] == 0.40
    assert (runs["closed"], "distilled") not in by_run

    db = refresh_duckdb()
    assert db == store / "kvlingo.duckdb"
    with duckdb.connect(str(db), read_only=True) as con:
        names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert {"runs", "bench", "best_translators", "lr_sweep", "bench_deltas"} <= names
    assert report_rows(db) == rows
    best = read_table(db, "best_translators")
    assert [(b["stage"], b["run_id"], b["val_kl"]) for b in best] == [("distilled", runs[3e-3], 0.25)]
    sweep = read_table(db, "lr_sweep")
    assert [(s["lr"], s["val_kl"], s["is_best"]) for s in sweep] == [(1e-3, 0.30, False), (3e-3, 0.25, True), (1e-2, 0.35, False)]
    deltas = {d["condition"]: d for d in read_table(db, "bench_deltas")}
    assert deltas["translated"]["delta"] == pytest.approx(-0.05) and deltas["translated"]["ci_method"] == "paired_bootstrap"
    assert (deltas["translated"]["ci_low"], deltas["translated"]["ci_high"]) == (-0.08, -0.02)
    unpaired = deltas["source_native"]
    half = 1.96 * (0.03**2 + 0.02**2) ** 0.5
    assert unpaired["ci_method"] == "normal_unpaired"
    assert (unpaired["ci_low"], unpaired["ci_high"]) == pytest.approx((-0.10 - half, -0.10 + half))
    # `report --json` carries the same deltas, JSON-safe.
    as_json = {d["condition"]: d for d in json.loads(json.dumps(report_json(db)["bench_deltas"]))}
    assert as_json["translated"]["delta"] == pytest.approx(-0.05) and as_json["translated"]["ci_method"] == "paired_bootstrap"
    assert set(as_json) == {"translated", "source_native"}

    files = export_parquet(db, tmp_path / "parquet")
    assert {f.name for f in files} == {f"{n}.parquet" for n in ("runs", "bench", "best_translators", "lr_sweep", "bench_deltas")}
    with duckdb.connect() as con:
        assert con.execute(f"SELECT count(*) FROM '{tmp_path / 'parquet' / 'runs.parquet'}'").fetchall() == [(7,)]


def test_empty_store_gives_empty_tables(store, tmp_path):
    db = refresh_duckdb(tmp_path / "s.duckdb")
    assert report_rows(db) == [] and read_table(db, "bench_deltas") == [] and read_table(db, "lr_sweep") == []


def test_cli_report_json_contract_rich_tables_and_parquet(store, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    summary, config, out = fake_fit(tmp_path)
    run_id = log_fit_run(summary, config, out)
    runner = CliRunner()
    result = runner.invoke(app, ["report", "--json", "--parquet", str(tmp_path / "pq")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # The sweep and benchmark-delta views travel too: one distilled rate (seed SD undefined: null), no benchmarks.
    sweep = report.pop("lr_sweep")
    assert [(r["source"], r["target"], r["lr"], r["val_kl"], r["is_best"], r["n_runs"], r["seed_sd_val_kl"],
             r["best_run_id"]) for r in sweep] == [("a", "b", 0.003, 0.25, True, 1, None, run_id)]
    assert report.pop("bench_deltas") == []
    assert report == {"runs": [
        {"source": "a", "target": "b", "stage": "closed_form", "val_kl": 0.40, "lr": None, "run_id": run_id},
        {"source": "a", "target": "b", "stage": "distilled", "val_kl": 0.25, "lr": 0.003, "run_id": run_id},
    ], "best_translators": [
        {"source": "a", "target": "b", "stage": "distilled", "val_kl": 0.25, "lr": 0.003, "run_id": run_id,
         "val_set_hash": None},
    ], "best_translators_ranking": RANKING_NOTE}
    assert (tmp_path / "pq" / "lr_sweep.parquet").is_file()
    result = runner.invoke(app, ["report"])
    assert result.exit_code == 0 and "best translator a → b" in result.stdout and "3.0e-03" in result.stdout


def test_report_gives_the_seed_sd_beside_the_item_se(store, tmp_path):
    # A fit with --seeds logs its seed mean and SD; sweep cells of one rate and several seeds get mean ± seed SD.
    summary, config, out = fake_fit(tmp_path, lr=1e-3, distilled_kl=0.2)
    summary = {**summary, "val_kl_seed_sd": {"distilled": 0.03}}
    seeded = log_fit_run(summary, config, out)
    for kl in (0.30, 0.34):
        s, c, o = fake_fit(tmp_path / str(kl), lr=2e-3, distilled_kl=kl)
        log_fit_run(s, c, o)
    db = refresh_duckdb()
    rows = {r["run_id"]: r for r in read_table(db, "runs") if r["stage"] == "distilled"}
    assert rows[seeded]["val_kl_seed_sd"] == 0.03 and rows[seeded]["val_kl_se"] == 0.01
    sweep = {r["lr"]: r for r in read_table(db, "lr_sweep")}
    assert sweep[2e-3]["mean_val_kl"] == pytest.approx(0.32)
    assert sweep[2e-3]["seed_sd_val_kl"] == pytest.approx(0.04 / 2 ** 0.5)  # sample SD of 0.30 and 0.34
    assert sweep[2e-3]["mean_item_se"] == pytest.approx(0.01) and sweep[2e-3]["n_runs"] == 2


def test_the_default_store_follows_kvlingo_home_within_one_process(tmp_path, monkeypatch):
    # MLflow exports the URI it is given; kvlingo's own default must not turn into a pinned user choice.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from registry.tracking import tracking_uri, use_tracking_store

    monkeypatch.setenv("KVLINGO_HOME", str(tmp_path / "a"))
    assert use_tracking_store().startswith(f"sqlite:///{tmp_path / 'a'}")
    monkeypatch.setenv("KVLINGO_HOME", str(tmp_path / "b"))
    assert tracking_uri().startswith(f"sqlite:///{tmp_path / 'b'}") and "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'user.db'}")  # a user's choice stays
    assert use_tracking_store() == f"sqlite:///{tmp_path / 'user.db'}"
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'user.db'}"
