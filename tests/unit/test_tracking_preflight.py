"""Fault (issue #11): an unreachable MLFLOW_TRACKING_URI fails before any training, fast, with a clear message."""

import json
import socket
import time

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, words
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(60, seed=i)}) for i in range(12)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6,
                                      "n_train": 8, "n_val": 2, "steps": 2}))
    return {"model": str(save_tiny_model_dir("qwen3", root / "q")), "config": str(config)}


@pytest.fixture
def closed_port_uri(monkeypatch) -> str:
    with socket.socket() as sock:  # a loopback port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def model_loads(monkeypatch) -> list[str]:
    """Names of the models loaded (or embedded models built) during the test."""
    import infra.tiny_models
    import infra.zoo

    loads: list[str] = []
    monkeypatch.setattr(infra.zoo, "load_model", lambda name, *a, **k: loads.append(name))
    monkeypatch.setattr(infra.tiny_models, "ensure_tiny_model", lambda name, *a, **k: loads.append(name))
    return loads


def commands(setup) -> dict[str, list[str]]:
    model, config = setup["model"], setup["config"]
    return {
        "fit --track": ["fit", model, model, "--config", config, "--track", "--json"],
        "sweep": ["sweep", model, model, "--config", config, "--n-rates", "3", "--one-direction", "--json"],
        "demo": ["demo", "--steps", "2", "--json"],
    }


@pytest.mark.parametrize("command", ["fit --track", "sweep", "demo"])
def test_unreachable_tracking_server_exits_2_before_any_work(setup, kvlingo_home, closed_port_uri, model_loads, command):
    started = time.monotonic()
    result = runner.invoke(app, commands(setup)[command])
    elapsed = time.monotonic() - started

    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert f"the MLflow tracking server {closed_port_uri} is not reachable" in message
    assert "Start it" in message and "unset $MLFLOW_TRACKING_URI to log into the local store" in message
    assert result.stdout == ""  # no JSON result on a failure
    assert model_loads == []  # no model loaded or built
    assert not (kvlingo_home / "runs").exists()  # no run directory claimed
    # Loose bound: catches MLflow's minutes-long HTTP retry loop, not a speed goal.
    assert elapsed < 10
