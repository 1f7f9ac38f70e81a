"""Stage 2 returns its best checkpoint on conversations held out from it (tasks.fit.best_checkpoint)."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from infra.config import FitConfig
from tasks.fit import best_checkpoint, selection_size
from tests.tiny_configs import noisy_identity, tiny_model
from translators.layout import cache_layout


def _checkpoints(tmp_path, translator, scales):
    """step_<s> checkpoints whose maps are the closed form's times `scale`."""
    for step, scale in scales.items():
        directory = tmp_path / f"step_{step:06d}"
        directory.mkdir(parents=True)
        save_file({n: (p.detach() * scale).contiguous() for n, p in translator.maps.items()},
                  str(directory / "translator.safetensors"))


def _distance_to(translator, scale):
    """A score that is lowest for the maps closest to `scale` × the closed form's."""
    reference = {n: p.detach() * scale for n, p in translator.maps.items()}
    return lambda t: sum((t.maps[n].detach() - w).norm().item() for n, w in reference.items())


@pytest.fixture
def closed_form():
    return noisy_identity(cache_layout(tiny_model("llama", seed=0)))


def test_the_checkpoint_of_lowest_score_is_returned_with_every_score(closed_form, tmp_path):
    _checkpoints(tmp_path, closed_form, {50: 1.5, 100: 2.0, 150: 1.2})
    last = copy.deepcopy(closed_form)
    chosen, record = best_checkpoint(last, closed_form, tmp_path, _distance_to(closed_form, 2.0))
    assert record["step"] == 100 and list(record["kl"]) == ["0", "50", "100", "150"]
    assert record["kl"]["100"] == pytest.approx(0.0, abs=1e-5)
    for name, weight in closed_form.maps.items():
        torch.testing.assert_close(chosen.maps[name], weight.detach() * 2.0)
        assert torch.equal(last.maps[name], weight)  # the caller's translator is left alone


def test_the_closed_form_wins_when_stage_2_only_made_it_worse(closed_form, tmp_path):
    _checkpoints(tmp_path, closed_form, {50: 1.5, 100: 3.0})
    chosen, record = best_checkpoint(copy.deepcopy(closed_form), closed_form, tmp_path, _distance_to(closed_form, 1.0))
    assert record["step"] == 0
    assert all(torch.equal(chosen.maps[n], w) for n, w in closed_form.maps.items())
    assert chosen is not closed_form


def test_the_selection_set_is_at_most_a_tenth_of_the_training_set():
    assert selection_size(FitConfig(source="a", target="b")) == 60
    assert selection_size(FitConfig(source="a", target="b", n_train=200)) == 20
    assert selection_size(FitConfig(source="a", target="b", n_train=80)) == 8
    assert selection_size(FitConfig(source="a", target="b", n_train=79)) == 0  # 7 would choose by noise
    assert selection_size(FitConfig(source="a", target="b", n_select=0)) == 0
