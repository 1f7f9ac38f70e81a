"""`kvlingo ui`'s server over a store with one logged fit and one registered translator: REST listing, two
headless-Chromium screenshots (runs page, models page), and no process left behind after it stops."""

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from registry.tracking import log_fit_run, log_translator_model, tracking_client
from registry.ui import group_alive, serve_ui
from translators.artifact import save_translator
from translators.translator import Translator

pytestmark = pytest.mark.integration

SRC = {"name": "ui-src", "identity": {"gguf_sha256": "1" * 64}, "config_sha256": "c1", "tokenizer_sha256": "t", "layout": {"n_layers": 3}}
TGT = {"name": "ui-tgt", "identity": {"gguf_sha256": "2" * 64}, "config_sha256": "c2", "tokenizer_sha256": "t", "layout": {"n_layers": 2}}
ASSIGNMENT = {"keys": {0: (0, 1), 1: (2, 1)}, "values": {0: (0, 2), 1: (1, 2)}}
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
    "--window-size=1400,900", "--virtual-time-budget=15000",
]
MIN_PNG_BYTES = 10_000  # a blank 1400×900 page compresses to a few kB


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed: `apt-get install chromium` (infra/bootstrap.sh installs it unless "
                    "KVLINGO_BROWSER_TESTS=0)")
    return path


def logged_store(tmp_path: Path) -> tuple[str, str]:
    """One distilled fit logged and its translator registered; returns (experiment id, run id)."""
    out = tmp_path / "fit"
    for seed, stage in enumerate(("closed_form", "distilled")):
        tr = Translator(ASSIGNMENT, d_src=4, d_tgt=6, point="pre_norm")
        g = torch.Generator().manual_seed(seed)
        for p in tr.maps.values():
            p.data.copy_(torch.randn(p.shape, generator=g))
        save_translator(tr, out / stage, source=SRC, target=TGT,
                        fit={"stage": stage, "val_kl": {"closed_form": 0.4, "distilled": 0.25}})
    history = [{"step": s, "train_kl": 1.0 / s, "lr": 1e-3} for s in range(1, 9)]
    history[3]["val_kl"], history[7]["val_kl"] = 0.3, 0.25
    summary = {
        "source": "ui-src", "target": "ui-tgt", "stage": "distilled",
        "val_kl": {"closed_form": 0.4, "empty_prefix": 2.5, "random_map": 9.0, "distilled": 0.25},
        "r2": {"keys": 0.8, "values": 0.6}, "r2_per_layer": {"keys": [0.7, 0.9], "values": [0.5, 0.7]},
        "assignment": {side: {str(t): list(s) for t, s in ASSIGNMENT[side].items()} for side in ASSIGNMENT},
        "history": history,
    }
    run_id = log_fit_run(summary, {"source": "ui-src", "target": "ui-tgt", "lr": 1e-3, "steps": 8}, out)
    log_translator_model(out / "distilled", run_id=run_id)
    return tracking_client().get_experiment_by_name("ui-src--ui-tgt").experiment_id, run_id


def rest(url: str, body: dict | None = None) -> dict:
    """GET (or POST `body`) against the local server, bypassing any proxy from the environment."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with opener.open(request, timeout=30) as response:
        return json.loads(response.read())


def screenshot(browser: str, url: str, png: Path, profile: Path) -> None:
    """Render `url` headless into `png`; the browser runs in its own process group, killed on timeout."""
    proc = subprocess.Popen([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}", url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish rendering {url} in 180 s")
    assert png.is_file(), output.decode(errors="replace")[-2000:]


def test_ui_lists_the_run_and_model_and_screenshots_show_them(kvlingo_home, monkeypatch, tmp_path):
    browser = chromium()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment_id, run_id = logged_store(tmp_path)
    shots = {"runs": tmp_path / "ui_runs.png", "models": tmp_path / "ui_models.png", "model": tmp_path / "ui_model.png"}

    with serve_ui() as server:
        runs = rest(f"{server.url}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id]})["runs"]
        assert [r["info"]["run_id"] for r in runs if r["info"]["run_name"].startswith("fit")] == [run_id]
        models = rest(f"{server.url}/api/2.0/mlflow/registered-models/search")["registered_models"]
        assert [m["name"] for m in models] == ["ui-src--ui-tgt"]
        # workflowType: a fresh browser profile would open MLflow 3's GenAI (traces) view instead of the runs table.
        ml = "workflowType=machine_learning"
        screenshot(browser, f"{server.url}/#/experiments/{experiment_id}/runs?{ml}", shots["runs"], tmp_path / "chrome-1")
        screenshot(browser, f"{server.url}/#/models?{ml}", shots["models"], tmp_path / "chrome-2")
        # The model's own page: its versions with the `candidate` alias and the pair tags.
        screenshot(browser, f"{server.url}/#/models/ui-src--ui-tgt?{ml}", shots["model"], tmp_path / "chrome-3")
        pgid = server.pgid
        assert group_alive(pgid)

    assert not group_alive(pgid), "the UI server's process group survived the context manager"
    for png in shots.values():
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > MIN_PNG_BYTES, (png, png.stat().st_size)
    # Kept as test artifacts: $KVLINGO_TEST_ARTIFACTS, else test-artifacts/ in the checkout (git-ignored).
    keep = Path(os.environ.get("KVLINGO_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
    keep.mkdir(parents=True, exist_ok=True)
    for png in shots.values():
        shutil.copy(png, keep / png.name)
