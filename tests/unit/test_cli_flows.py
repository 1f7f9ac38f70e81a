"""The flow commands end to end through the CLI on tiny random-init local models: `sweep`, `fit --track`,
`bench multiturn` on two fits and `ui`; and the refusals of a bad `--config` (exit 2, no traceback)."""

import contextlib
import json
import os
import signal
import threading
import urllib.request
from types import SimpleNamespace

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, words
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two tiny models and the smallest configs that still fit: `fit.yaml` for fits, `sweep.yaml` for sweep cells
    (self-translation from a heavily shrunk closed form, as in test_sweep_cells.py)."""
    root = tmp_path_factory.mktemp("cli-flows")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(60, seed=i)}) for i in range(12)))
    small = {"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6, "n_train": 8, "n_val": 2,
             "steps": 2, "batch": 4, "eval_every": 2, "checkpoint_every": 2}
    fit_config, sweep_config = root / "fit.yaml", root / "sweep.yaml"
    fit_config.write_text(yaml.safe_dump(small))
    # A pair in a config file is overridden by the command line's SOURCE TARGET, as for `kvlingo fit`.
    # ν = 1: each target layer reads its own layer, so the shrunk self-map has one clear best rate in the window.
    sweep_config.write_text(yaml.safe_dump({**small, "ridge": 30.0, "assignment": "depth", "nu": 1,
                                            "target": "not-the-pair"}))
    return {
        "qwen": str(save_tiny_model_dir("qwen3", root / "qwen3", max_position_embeddings=512)),
        "llama": str(save_tiny_model_dir("llama", root / "llama", max_position_embeddings=512)),
        "fit_config": str(fit_config), "sweep_config": str(sweep_config), "root": root,
    }


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_clean_refusal(result, message: str) -> None:
    """Exit 2 with `message` on stderr, nothing on stdout and no traceback."""
    assert result.exit_code == 2, result.output
    assert message in flat(result.stderr)
    assert result.stdout == "" and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


@pytest.fixture
def bad_configs(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump([{"steps": 2}, {"lr": 1e-3}]))
    broken = tmp_path / "broken.yaml"
    broken.write_text("steps: [2\n")
    return {"missing": (tmp_path / "missing.yaml", "does not exist"),
            "list": (listed, "must hold a mapping of config keys (key: value lines), got a list"),
            "broken": (broken, "is not valid YAML"),
            "directory": (tmp_path, "is a directory, not a file")}


@pytest.mark.parametrize("command", ["sweep", "fit"])
@pytest.mark.parametrize("case", ["missing", "list", "broken", "directory"])
def test_a_bad_config_file_exits_2_naming_it(setup, kvlingo_home, bad_configs, command, case):
    path, message = bad_configs[case]
    extra = ["--one-direction", "--n-rates", "3"] if command == "sweep" else ["--stage1-only"]
    result = runner.invoke(app, [command, setup["qwen"], setup["qwen"], "--config", str(path), *extra, "--json"])
    assert_clean_refusal(result, f"config file {path} {message}")
    assert not (kvlingo_home / "runs").exists()  # refused before any work


def test_sweep_one_direction_json(setup, kvlingo_home):
    from registry.tracking import pair_name

    model = setup["qwen"]
    result = runner.invoke(app, ["sweep", model, model, "--one-direction", "--n-rates", "3", "--centre-lr", "1e-3",
                                 "--config", setup["sweep_config"], "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert list(out) == [pair_name(model, model)]
    cell = out[pair_name(model, model)]
    assert set(cell) == {"selected_lr", "val_kl_by_lr", "other_seeds", "trained_runs"}
    assert len(cell["val_kl_by_lr"]) >= 3 and len(cell["trained_runs"]) == len(cell["val_kl_by_lr"])
    assert f"{cell['selected_lr']:.3g}" in cell["val_kl_by_lr"] and cell["other_seeds"] == {}


def test_fit_track_json_logs_and_registers(setup, kvlingo_home):
    from registry.tracking import pair_name, tracking_client

    source, target = setup["qwen"], setup["llama"]
    result = runner.invoke(app, ["fit", source, target, "--config", setup["fit_config"], "--track", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["steps"] == 2 and isinstance(out["val_kl"]["distilled"], float)
    name = pair_name(source, target)
    assert out["registry"]["name"] == name and out["registry"]["model_uri"] == f"models:/{name}/1"
    assert out["registry"]["champion"]["version"] == 1
    assert {row["benchmark"] for row in out["benchmarks"]} >= {"corpus_kl", "first_token_kl"}
    run = tracking_client().get_run(out["run_id"])
    assert run.data.tags["kvlingo.fingerprint"] == out["fingerprint"]
    assert run.info.experiment_id == tracking_client().get_experiment_by_name(name).experiment_id


def test_bench_multiturn_on_two_fits(setup, kvlingo_home):
    a, b, root = setup["qwen"], setup["llama"], setup["root"]
    for source, target, out in ((a, b, root / "ab"), (b, a, root / "ba")):
        fit = runner.invoke(app, ["fit", source, target, "--stage1-only", "--config", setup["fit_config"],
                                  "--output-dir", str(out), "--json"])
        assert fit.exit_code == 0, fit.output
    result = runner.invoke(app, ["bench", "multiturn", a, b, "--stage", "closed_form", "--fit-dir-ab", str(root / "ab"),
                                 "--fit-dir-ba", str(root / "ba"), "--conversations", "1", "--turns", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["turns"] == 2 and out["stage"] == "closed_form"
    assert set(out["modes"]) == {"reprefill", "segment", "naive"}
    for row in out["modes"].values():
        assert len(row["per_turn"]) == 2 and 0.0 <= row["mean"] <= 1.0
    assert out["modes"]["segment"]["max_times_a_span_was_translated"] == 1


def test_ui_serves_until_sigterm_then_exits_0(kvlingo_home, monkeypatch):
    """`kvlingo ui` in-process: it answers HTTP 200 on 127.0.0.1, and one SIGTERM (what a service manager sends)
    stops it with exit code 0 and no process left behind."""
    from registry import ui as ui_module

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    port = ui_module.free_port()
    seen: dict = {}
    served, done = threading.Event(), threading.Event()
    serve_forever = ui_module.serve_forever

    def recording_serve_forever(port, host, on_ready):
        def ready(server) -> None:  # the server answers, and the command has printed its address
            on_ready(server)
            seen["server"] = server
            served.set()

        return serve_forever(port, host, ready)

    monkeypatch.setattr(ui_module, "serve_forever", recording_serve_forever)

    def request_then_stop() -> None:
        while not served.wait(0.25):
            if done.is_set():  # the command ended without serving: nothing to stop
                return
        try:
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://127.0.0.1:{port}/", timeout=30) as response:
                seen["status"] = response.status
        except Exception as err:  # reported by the assertions below, after the server has stopped
            seen["status"] = repr(err)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread, by `serve_forever`'s handler

    # `serve_forever` restores this handler on return: a SIGTERM arriving later can never end pytest.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    stopper = threading.Thread(target=request_then_stop, daemon=True)
    try:
        stopper.start()
        result = runner.invoke(app, ["ui", "--port", str(port)])
    finally:
        done.set()
        stopper.join(timeout=40)
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 0, result.output
    assert seen["status"] == 200
    assert f"MLflow UI at http://127.0.0.1:{port}" in flat(result.stdout)
    assert not ui_module.group_alive(seen["server"].pgid)


def test_a_stop_signal_swallowed_by_a_finalizer_still_stops_the_ui(monkeypatch):
    """Regression: the handler's KeyboardInterrupt is dropped when the signal lands in a finalizer or weakref
    callback (seen with `kvlingo ui` under load); the recorded stop request must still end the serving loop."""
    from registry import ui as ui_module

    polls = iter([None, None, 0])  # the fake server "dies" after two polls: exit code 1 if the stop were lost
    server = SimpleNamespace(process=SimpleNamespace(poll=lambda: next(polls)), url="http://127.0.0.1:1")

    @contextlib.contextmanager
    def fake_serve_ui(port, host):
        yield server

    def ready(_server) -> None:
        try:  # what Python does when the handler fires inside a finalizer: the exception goes nowhere
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        except KeyboardInterrupt:
            pass

    monkeypatch.setattr(ui_module, "serve_ui", fake_serve_ui)
    before = signal.getsignal(signal.SIGTERM)
    assert ui_module.serve_forever(None, "127.0.0.1", ready) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
