"""Integration tests of the embedded tiny model pair (builds both on first run, minutes on CPU).

The build is cached under ``$KVLINGO_HOME/models``, so later runs reuse it.
"""

from __future__ import annotations

import pytest

from infra.synthetic_chat import recall_items
from infra.tiny_models import (
    BUILD_FILE,
    HELDOUT_SEED,
    TINY_MODELS,
    ensure_tiny_model,
    evaluate_recall,
    load_tiny_model,
    render_chat,
)
from translators.errors import ConfigError

pytestmark = pytest.mark.integration

N_ITEMS = 90  # 30 per kind


@pytest.fixture(scope="module")
def pair():
    """Both tiny models and their tokenizers, built (or loaded from cache) once per module."""
    return {name: load_tiny_model(name, progress=False) for name in TINY_MODELS}


def test_pair_shares_one_tokenizer(pair):
    (_, tok_s), (_, tok_l) = pair["kvlingo-tiny-s"], pair["kvlingo-tiny-l"]
    assert tok_s.get_vocab() == tok_l.get_vocab()
    text = "Remember: the code for ORCHID-27 is 4817. ünïcödé ✓ \t\n"
    assert tok_s(text)["input_ids"] == tok_l(text)["input_ids"]
    assert tok_s.decode(tok_s(text)["input_ids"]) == text


def test_chat_template_matches_python_rendering(pair):
    _, tok = pair["kvlingo-tiny-s"]
    messages = recall_items(3, HELDOUT_SEED)[0].messages
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_pair_differs_in_depth_width_and_kv_heads(pair):
    cfg_s, cfg_l = pair["kvlingo-tiny-s"][0].config, pair["kvlingo-tiny-l"][0].config
    assert cfg_s.model_type == cfg_l.model_type == "qwen3"
    assert cfg_s.num_hidden_layers != cfg_l.num_hidden_layers
    assert cfg_s.hidden_size != cfg_l.hidden_size
    assert cfg_s.num_key_value_heads != cfg_l.num_key_value_heads
    assert cfg_s.vocab_size == cfg_l.vocab_size


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_recall_clearly_above_chance(pair, name):
    model, tokenizer = pair[name]
    scores = evaluate_recall(model, tokenizer, recall_items(N_ITEMS, HELDOUT_SEED))
    print(name, {k: round(v, 4) for k, v in scores.items()})
    assert scores["overall"] >= 0.5, scores
    assert scores["overall"] >= 10 * scores["chance"], scores


def test_second_call_reuses_cache(pair):
    for name in TINY_MODELS:
        build_json = ensure_tiny_model(name, progress=False) / BUILD_FILE
        before = build_json.stat().st_mtime_ns
        assert ensure_tiny_model(name, progress=False) / BUILD_FILE == build_json
        assert build_json.stat().st_mtime_ns == before


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ConfigError, match="kvlingo-tiny-s"):
        ensure_tiny_model("kvlingo-tiny-z")
