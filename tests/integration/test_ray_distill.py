"""Stage 2 through Ray Train: 2 workers × accumulation 4 follow the single-process × 8 trajectory."""

import pytest
import torch
from tiny_configs import noisy_identity, save_tiny_model_dir

from flows.distill import run_ray, run_single
from infra.zoo import load_model
from translators.stage1 import Side
from translators.train import TrainSettings

pytestmark = pytest.mark.integration


def sample(seed, n=14, m=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g), torch.randint(0, 97, (m,), generator=g)


def test_two_ray_workers_match_single_process(tmp_path, kvlingo_home):
    path = str(save_tiny_model_dir("qwen3", tmp_path / "qwen3"))
    loaded = load_model(path)
    side = Side(loaded.model, loaded.layout)
    train, val = [sample(i) for i in range(16)], [sample(100 + i) for i in range(2)]
    settings = TrainSettings(lr=3e-3, steps=3, batch=8, eval_every=3, checkpoint_every=2)
    single, h1 = run_single(noisy_identity(loaded.layout), side, side, train, val, settings, {"run": 1}, tmp_path / "a")
    ray, h2 = run_ray(noisy_identity(loaded.layout), path, path, train, val, settings, {"run": 1}, tmp_path / "b", workers=2)
    assert [r["step"] for r in h2 if r.get("rank", 0) == 0] == [1, 2, 3]
    for a, b in zip(h1, h2):
        assert a["train_kl"] == pytest.approx(b["train_kl"], rel=1e-5)
    for name in single.maps:
        torch.testing.assert_close(ray.maps[name], single.maps[name], atol=1e-4, rtol=1e-4)
    assert (tmp_path / "b" / "step_000002" / "state.json").is_file()  # Ray rank 0 checkpoints like the loop
