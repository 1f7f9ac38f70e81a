"""Regression (issue #11): sweep cells are keyed by the full run fingerprint and searched in the pair's experiment.

Before, a cell was keyed by pair|lr|seed|steps and searched across every experiment, so a sweep with another
config (here: another ridge) or a rebuilt model of the same name got the old validation KL back without training.
"""

import json

import pytest
from tiny_configs import save_tiny_model_dir, words

SWEEP = dict(both_directions=False, centre_lr=1e-3, n_rates=3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-cells")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(60, seed=i)}) for i in range(12)))
    model = str(save_tiny_model_dir("qwen3", root / "q"))
    # Self-translation from a heavily shrunk closed form (ridge 30): distillation has an optimum in the rate
    # (tests/integration/test_flows.py), so the window extends little beyond its three rates.
    base = {"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6, "n_train": 8, "n_val": 2,
            "steps": 2, "batch": 4, "eval_every": 2, "checkpoint_every": 2, "ridge": 30.0, "assignment": "depth",
            "nu": 1}
    return {"pairs": [(model, model)], "base": base}


def cell_tags(name: str) -> dict[str, str]:
    """run id → kvlingo.cell tag of every cell run in experiment `name`."""
    from registry.tracking import tracking_client

    client = tracking_client()
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`kvlingo.cell` != ''", max_results=1000)
    return {run.info.run_id: run.data.tags["kvlingo.cell"] for run in runs}


def test_a_sweep_with_another_ridge_trains_again_and_a_repeat_trains_nothing(pair, kvlingo_home):
    from flows.pipeline import sweep_flow
    from registry.tracking import pair_name

    name = pair_name(*pair["pairs"][0])
    first = sweep_flow(pair["pairs"], base=pair["base"], **SWEEP)[name]
    assert len(first["trained_runs"]) == len(first["val_kl_by_lr"]) >= 3  # one cell per rate tried
    first_cells = cell_tags(name)
    assert sorted(first_cells) == sorted(first["trained_runs"])

    other = sweep_flow(pair["pairs"], base={**pair["base"], "ridge": 3.0}, **SWEEP)[name]
    # Every cell of the other config trains: its fingerprint differs even though pair, rates, seed and steps agree.
    assert len(other["trained_runs"]) == len(other["val_kl_by_lr"]) >= 3
    assert not set(other["trained_runs"]) & set(first_cells)
    shared_rates = set(first["val_kl_by_lr"]) & set(other["val_kl_by_lr"])
    assert len(shared_rates) >= 3  # at least the initial window
    for lr in shared_rates:  # another closed form to start from: another validation KL at the same rate
        assert other["val_kl_by_lr"][lr] != pytest.approx(first["val_kl_by_lr"][lr], rel=1e-3)
    other_cells = {run: key for run, key in cell_tags(name).items() if run not in first_cells}
    assert len(set(other_cells.values())) == len(other_cells) and not set(other_cells.values()) & set(first_cells.values())

    again = sweep_flow(pair["pairs"], base=pair["base"], **SWEEP)[name]
    assert again["trained_runs"] == []
    assert again["val_kl_by_lr"] == first["val_kl_by_lr"] and again["selected_lr"] == first["selected_lr"]
    assert len(cell_tags(name)) == len(first_cells) + len(other_cells)  # nothing logged twice


def test_a_rebuilt_model_of_the_same_name_trains_again(pair, kvlingo_home, tmp_path):
    from flows.pipeline import sweep_flow
    from registry.tracking import pair_name
    from tasks.prefect_tasks import cached_model

    model = str(save_tiny_model_dir("qwen3", tmp_path / "q"))
    pairs, name = [(model, model)], pair_name(model, model)
    first = sweep_flow(pairs, base=pair["base"], **SWEEP)[name]
    save_tiny_model_dir("qwen3", model, seed=1)  # other weights under the same path
    cached_model.cache_clear()  # this process loaded the old build (a new CLI process would load the new one)
    rebuilt = sweep_flow(pairs, base=pair["base"], **SWEEP)[name]
    assert len(rebuilt["trained_runs"]) == len(rebuilt["val_kl_by_lr"]) >= 3
    assert not set(rebuilt["trained_runs"]) & set(first["trained_runs"])
    for lr in set(first["val_kl_by_lr"]) & set(rebuilt["val_kl_by_lr"]):
        assert rebuilt["val_kl_by_lr"][lr] != pytest.approx(first["val_kl_by_lr"][lr], rel=1e-3)
