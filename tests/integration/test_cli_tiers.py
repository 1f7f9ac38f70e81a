"""`kvlingo fit --workers 2` through the CLI: stage 2 on a local Ray (two gloo workers) on tiny local models,
against the same fit in one process."""

import json
import math

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, words
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.integration

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(24)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6,
                                      "n_train": 8, "n_val": 4, "steps": 2, "batch": 4, "eval_every": 2,
                                      "checkpoint_every": 2}))
    return {"qwen": str(save_tiny_model_dir("qwen3", root / "qwen3")), "llama": str(save_tiny_model_dir("llama", root / "llama")),
            "config": str(config), "root": root}


def fit(setup, workers: int, out: str):
    return runner.invoke(app, ["fit", setup["qwen"], setup["llama"], "--config", setup["config"], "--workers", str(workers),
                               "--output-dir", str(setup["root"] / out), "--json"])


def test_fit_with_two_ray_workers_matches_one_process(setup, kvlingo_home):
    ray_run = fit(setup, 2, "ray")
    assert ray_run.exit_code == 0, ray_run.output
    ray_summary = json.loads(ray_run.stdout)
    assert ray_summary["stage"] == "distilled" and ray_summary["steps"] == 2
    assert [h["step"] for h in ray_summary["history"] if "train_kl" in h][-1] == 2
    assert (setup["root"] / "ray" / "distilled" / "manifest.json").is_file()
    single = fit(setup, 1, "single")
    assert single.exit_code == 0, single.output
    single_summary = json.loads(single.stdout)
    # Workers are execution placement, not a result: one fingerprint, and the same trajectory (rounding aside:
    # here the process and the workers run different torch thread counts).
    assert ray_summary["fingerprint"] == single_summary["fingerprint"]
    kl_ray, kl_single = ray_summary["val_kl"]["distilled"], single_summary["val_kl"]["distilled"]
    assert math.isfinite(kl_ray) and kl_ray == pytest.approx(kl_single, rel=1e-3)
    assert ray_summary["val_kl"]["closed_form"] == single_summary["val_kl"]["closed_form"]
