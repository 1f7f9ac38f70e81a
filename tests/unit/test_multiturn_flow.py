"""`bench multiturn` plumbing on tiny random models: modes, per-turn rows and the translation counters."""

import json

import pytest
from tiny_configs import save_tiny_model_dir, words

from flows.fit import run_fit
from tasks.multiturn import run_multiturn
from infra.config import FitConfig
from translators.errors import ConfigError


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    a = str(save_tiny_model_dir("qwen3", root / "a", max_position_embeddings=512))
    b = str(save_tiny_model_dir("llama", root / "b", max_position_embeddings=512))
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(30)))
    common = dict(data=str(data), max_prefix_tokens=40, max_continuation_tokens=8, n_train=16, n_val=4, stage1_only=True)
    with pytest.MonkeyPatch.context() as patch:  # the fits' statistics shards stay out of the user's store
        patch.setenv("KVLINGO_HOME", str(root / "home"))
        run_fit(FitConfig(source=a, target=b, output_dir=root / "ab", **common))
        run_fit(FitConfig(source=b, target=a, output_dir=root / "ba", **common))
    assert len(list((root / "home" / "stats").iterdir())) == 4  # two shards (train, held-out) per direction
    return a, b, root


def test_modes_rows_and_counters(fitted):
    a, b, root = fitted
    result = run_multiturn(a, b, stage="closed_form", fit_dir_ab=root / "ab", fit_dir_ba=root / "ba",
                           n_conversations=1, turns=4, max_new_tokens=2)
    assert set(result["modes"]) == {"reprefill", "segment", "naive"}
    for row in result["modes"].values():
        assert len(row["per_turn"]) == 4 and all(0.0 <= x <= 1.0 for x in row["per_turn"])
    assert result["modes"]["reprefill"]["max_times_a_span_was_translated"] == 0
    assert result["modes"]["segment"]["max_times_a_span_was_translated"] == 1
    assert result["modes"]["naive"]["max_times_a_span_was_translated"] > 1


def test_missing_translator_says_which_fit_to_run(fitted, tmp_path):
    a, b, root = fitted
    with pytest.raises(ConfigError, match="kvlingo fit"):
        run_multiturn(a, b, stage="distilled", fit_dir_ab=root / "ab", fit_dir_ba=root / "ba")


@pytest.mark.parametrize("turns", [1, 13])
def test_turns_out_of_range_is_a_config_error(turns):
    with pytest.raises(ConfigError, match="2 to 12 turns"):
        run_multiturn("no-model-is-loaded", "before-validation", turns=turns)
