"""Stage 2 returns its last step unless an earlier checkpoint is better beyond noise on conversations held out
from it (translators.checkpoint_selection, tasks.fit.best_checkpoint)."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from infra.config import FitConfig
from tasks.fit import best_checkpoint, selection_size
from translators.checkpoint_selection import choose_checkpoint, paired_difference
from translators.errors import ConfigError
from translators.stage1 import ValidationKL
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
    """A score that is lowest for the maps closest to `scale` × the closed form's: per map, its distance plus a
    small spread, as the per-sample KLs of one selection set (every candidate is scored on the same "samples")."""
    reference = {n: p.detach() * scale for n, p in translator.maps.items()}

    def score(t):
        distances = [(t.maps[n].detach() - w).norm().item() for n, w in reference.items()]
        return ValidationKL.of([d + 0.001 * i for i, d in enumerate(distances)], distances)

    return score


@pytest.fixture
def closed_form():
    return noisy_identity(cache_layout(tiny_model("llama", seed=0)))


def test_an_earlier_checkpoint_better_on_every_sample_is_returned_with_every_score(closed_form, tmp_path):
    _checkpoints(tmp_path, closed_form, {50: 1.5, 100: 2.0, 150: 1.2})
    last = copy.deepcopy(closed_form)
    chosen, record = best_checkpoint(last, closed_form, tmp_path, _distance_to(closed_form, 2.0))
    assert record["step"] == 100 and list(record["kl"]) == ["0", "50", "100", "150"]
    assert record["kl"]["100"] == pytest.approx(0.001 * (len(closed_form.maps) - 1) / 2, abs=1e-5)
    assert record["margin_se"] == 2.0
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


def test_the_last_step_stays_unless_an_earlier_one_is_better_beyond_two_paired_standard_errors():
    noisy = [0.02, 0.03, 1.8, 0.02, 0.04, 0.01, 0.03, 0.02]  # one recall miss carries the mean
    lucky = [0.02, 0.03, 0.02, 0.02, 0.04, 0.01, 0.03, 1.5]  # a lower mean, from another single miss
    assert sum(lucky) < sum(noisy)
    assert choose_checkpoint({0: [0.2] * 8, 50: lucky, 100: noisy}) == 100  # not better beyond noise
    better = [x - 0.01 for x in noisy]  # lower on every sample: its paired standard error is 0
    assert choose_checkpoint({0: [0.2] * 8, 50: better, 100: noisy}) == 50
    ruined = [x + 0.5 for x in noisy]  # stage 2 undid a good closed form: the closed form comes back
    assert choose_checkpoint({0: noisy, 50: ruined, 100: [x + 0.4 for x in noisy]}) == 0


def test_among_earlier_checkpoints_better_beyond_noise_the_lowest_mean_wins_and_ties_go_earlier():
    last = [0.5, 0.6, 0.7, 0.8]
    assert choose_checkpoint({0: [0.3, 0.4, 0.5, 0.6], 50: [0.1, 0.2, 0.3, 0.4], 100: last}) == 50
    assert choose_checkpoint({0: [0.1, 0.2, 0.3, 0.4], 50: [0.1, 0.2, 0.3, 0.4], 100: last}) == 0
    assert choose_checkpoint({100: last}) == 100


def test_the_paired_difference_matches_its_formula_and_refuses_unpaired_lists():
    mean, se = paired_difference([1.0, 2.0, 4.0], [0.0, 1.0, 1.0])  # differences 1, 1, 3
    assert mean == pytest.approx(5 / 3)
    assert se == pytest.approx((((1 - 5 / 3) ** 2 * 2 + (3 - 5 / 3) ** 2) / 2 / 3) ** 0.5)
    with pytest.raises(ConfigError, match="two equally long lists"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ConfigError, match="no checkpoints"):
        choose_checkpoint({})
