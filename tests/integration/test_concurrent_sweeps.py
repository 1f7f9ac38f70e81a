"""Fault (issue #11): two sweeps started at the same time on one store neither corrupt it nor train a cell twice.

Two `kvlingo sweep` processes share one KVLINGO_HOME (sqlite MLflow store, statistics, run directory, Prefect
home). The test holds the first cell's lock until both processes wait for it, so both reach that cell before
either trains it; the per-cell lock then lets one train it while the other waits and reads it back.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, words

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
WAITING = "waiting for another kvlingo process"


@pytest.fixture
def sweep(tmp_path, monkeypatch) -> dict:
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(60, seed=i)}) for i in range(12)))
    model = str(save_tiny_model_dir("qwen3", tmp_path / "q"))
    config = tmp_path / "sweep.yaml"
    # Self-translation from a shrunk closed form (ridge 30, each target layer reading its own layer: ν = 1): the best
    # of the three rates is interior.
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6,
                                      "n_train": 8, "n_val": 2, "steps": 2, "batch": 4, "eval_every": 2,
                                      "checkpoint_every": 2, "ridge": 30.0, "assignment": "depth", "nu": 1}))
    home = tmp_path / "kvlingo-home"
    monkeypatch.setenv("KVLINGO_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    command = [sys.executable, "-m", "flows.cli", "sweep", model, model, "--config", str(config), "--centre-lr",
               "1e-3", "--n-rates", "3", "--one-direction", "--json"]
    return {"command": command, "model": model, "config": config, "home": home, "logs": tmp_path}


def first_cell_lock(model: str, config: Path) -> Path:
    """The lock file of the sweep's first cell (lowest rate of the window, seed 0), as flows.pipeline names it."""
    from tasks.fit import plan_fit
    from infra.config import FitConfig
    from infra.fingerprint import fingerprint
    from infra.locks import lock_path
    from translators.lr_selection import initial_rates

    fit_config = FitConfig(source=model, target=model, **yaml.safe_load(config.read_text()))
    plan = plan_fit(fit_config)
    key = fingerprint(plan.stage2_fields(fit_config.model_copy(update={"lr": initial_rates(1e-3, 3)[0], "seed": 0})))
    return lock_path(f"cell-{key}")


def start(command: list[str], home: Path, logs: Path, n: int) -> list[tuple[subprocess.Popen, Path, Path]]:
    """Start `n` copies of `command` on one KVLINGO_HOME; each writes stdout and stderr to files in `logs`."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_API_URL")}
    env["KVLINGO_HOME"] = str(home)
    started = []
    for i in range(n):
        out, err = logs / f"sweep{i}.out", logs / f"sweep{i}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            started.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr), out, err))
    return started


def wait_until_all_log(processes, text: str, timeout: float) -> None:
    """Return once every process's stderr holds `text`; fail when one exits first or on timeout."""
    deadline = time.monotonic() + timeout
    while not all(text in err.read_text() for _, _, err in processes):
        for process, _, err in processes:
            assert process.poll() is None, f"a sweep exited before it logged {text!r}:\n{err.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the sweeps did not both wait for {text!r} within {timeout} s"
        time.sleep(0.5)


def finish(processes) -> list[tuple[int, str, str]]:
    """Wait for every process (killing all on timeout); (returncode, stdout, stderr) each."""
    try:
        for process, _, _ in processes:
            process.wait(timeout=TIMEOUT_S)
    finally:
        for process, _, _ in processes:
            if process.poll() is None:
                process.kill()
    return [(process.returncode, out.read_text(), err.read_text()) for process, out, err in processes]


def test_two_sweeps_at_once_train_each_cell_once(sweep):
    from infra.locks import file_lock

    with file_lock(first_cell_lock(sweep["model"], sweep["config"]), "the test's start signal"):
        processes = start(sweep["command"], sweep["home"], sweep["logs"], n=2)
        wait_until_all_log(processes, f"{WAITING}: sweep cell lr=0.000316 seed=0", timeout=TIMEOUT_S)
    results = finish(processes)

    for code, _, err in results:
        assert code == 0, err[-4000:]
    (name, first), = json.loads(results[0][1]).items()
    second = json.loads(results[1][1])[name]
    # Both report the same selection from the same cells: one trained each cell, the other read it back.
    assert first["val_kl_by_lr"] == second["val_kl_by_lr"] and first["selected_lr"] == second["selected_lr"]
    trained = first["trained_runs"] + second["trained_runs"]
    assert len(trained) == len(set(trained)) == len(first["val_kl_by_lr"]) >= 3

    from registry.tracking import tracking_client

    client = tracking_client()
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id], max_results=1000)  # readable
    cells = [run for run in runs if "kvlingo.cell" in run.data.tags]
    keys = [run.data.tags["kvlingo.cell"] for run in cells]
    assert len(keys) == len(set(keys)) == len(first["val_kl_by_lr"])  # one run per cell key
    assert sorted(run.info.run_id for run in cells) == sorted(trained)
    assert all(run.info.status == "FINISHED" for run in cells)
    assert sorted(run.data.metrics["val_kl.distilled"] for run in cells) == sorted(first["val_kl_by_lr"].values())
    assert sum(run.data.tags.get("kvlingo.kind") == "sweep" for run in runs) == 2  # each sweep's parent run
    assert len(client.search_model_versions(f"name = '{name}'")) == len(keys)  # each cell registered once
