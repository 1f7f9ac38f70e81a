"""Prefect flows with MLflow tracking on tiny local models: tracked fit, sweep idempotence."""

import json

import pytest
from tiny_configs import save_tiny_model_dir, words

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("flows")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(30)))
    model = str(save_tiny_model_dir("qwen3", root / "q"))
    # Self-translation from a heavily shrunk closed form (ridge 30): distillation has a real optimum in the
    # learning rate (too small: no progress; too large: divergence), so the selected rate is interior.
    return {
        "source": model,
        "target": model,
        "base": {"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8, "n_train": 16, "n_val": 4,
                 "steps": 4, "batch": 4, "eval_every": 4, "checkpoint_every": 4, "ridge": 30.0, "assignment": "depth"},
    }


def test_sweep_twice_trains_nothing_the_second_time(pair, kvlingo_home):
    from flows.pipeline import sweep_flow
    from registry.tracking import pair_name, tracking_client

    kwargs = dict(pairs=[(pair["source"], pair["target"])], both_directions=False, centre_lr=1e-2, n_rates=3,
                  base=pair["base"])
    first = sweep_flow(**kwargs)
    name = pair_name(pair["source"], pair["target"])
    assert len(first[name]["trained_runs"]) >= 3
    client = tracking_client()
    experiment = client.get_experiment_by_name(name)
    runs_before = len(client.search_runs([experiment.experiment_id], max_results=1000))
    second = sweep_flow(**kwargs)
    assert second[name]["trained_runs"] == []
    assert second[name]["selected_lr"] == first[name]["selected_lr"]
    # Only the second sweep's own parent run is new: no cell was trained or logged again.
    assert len(client.search_runs([experiment.experiment_id], max_results=1000)) == runs_before + 1
    rates = sorted(float(r) for r in first[name]["val_kl_by_lr"])
    assert rates[0] < first[name]["selected_lr"] < rates[-1]  # the selected rate is interior (App. E)
