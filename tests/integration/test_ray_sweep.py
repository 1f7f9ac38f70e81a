"""Sweeps on Ray: the cells of a 5-rate × 2-seed sweep run concurrently on two actors of a local Ray, each cell
trains once, the selection equals the serial sweep's, and a re-run trains nothing. Wall times of both are printed
(`-s`), not asserted."""

import json
import time

import pytest
from tiny_configs import save_tiny_model_dir, words

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-sweep")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(30)))
    model = str(save_tiny_model_dir("qwen3", root / "q"))
    base = {"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8, "n_train": 16, "n_val": 4,
            "steps": 4, "batch": 4, "eval_every": 4, "checkpoint_every": 4, "ridge": 30.0, "assignment": "depth"}
    return model, base


def test_sweep_cells_run_on_two_ray_workers_once_each(pair, tmp_path, monkeypatch):
    from flows.pipeline import sweep_flow
    from registry.tracking import pair_name
    from tasks.cluster import release_workers

    model, base = pair
    name = pair_name(model, model)
    kwargs = dict(pairs=[(model, model)], both_directions=False, centre_lr=1e-2, n_rates=5, seeds=[0, 1])
    runs, walls = {}, {}
    for label, workers in (("serial", 1), ("ray", 2)):
        monkeypatch.setenv("KVLINGO_HOME", str(tmp_path / label))
        start = time.perf_counter()
        runs[label] = sweep_flow(base={**base, "workers": workers}, **kwargs)[name]
        walls[label] = time.perf_counter() - start
    print(f"\nsweep 5 rates x 2 seeds: serial {walls['serial']:.1f} s, 2 Ray workers {walls['ray']:.1f} s")
    serial, ray = runs["serial"], runs["ray"]
    cells = len(ray["val_kl_by_lr"]) + len(ray["other_seeds"])
    assert len(ray["val_kl_by_lr"]) >= 5 and list(ray["other_seeds"]) == [1]
    assert len(ray["trained_runs"]) == len(set(ray["trained_runs"])) == cells  # each cell once
    assert ray["val_kl_by_lr"].keys() == serial["val_kl_by_lr"].keys() and ray["selected_lr"] == serial["selected_lr"]
    for lr, kl in serial["val_kl_by_lr"].items():
        assert ray["val_kl_by_lr"][lr] == pytest.approx(kl, rel=1e-4, abs=1e-6), lr
    again = sweep_flow(base={**base, "workers": 2}, **kwargs)[name]
    release_workers()
    assert again["trained_runs"] == [] and again["val_kl_by_lr"] == ray["val_kl_by_lr"]
