"""Integration tests of the embedded MLA/DSA family (derives it on first run, minutes on CPU).

Builds into the real ``$KVLINGO_HOME/models`` cache (after the tiny GQA pair it derives from), so later runs
reuse it. Recall is scored on the held-out items the tiny-model build CLI uses.
"""

from __future__ import annotations

import json

import pytest

from infra.mla_models import MLA_MODELS, _root_tiny, ensure_mla_model, load_mla_model, recipe_hash
from infra.synthetic_chat import recall_items
from infra.tiny_models import BUILD_FILE, HELDOUT_SEED, evaluate_recall, load_tiny_model, render_chat

pytestmark = pytest.mark.integration

# 120, not 60: at 60 items the 0.05 tolerance is three answers, and session 21's build failed it by one
# (kvlingo-tiny-s-dsa 0.883 against kvlingo-tiny-s 0.950) where 120 items gave 0.883 against 0.917.
N_ITEMS = 120  # `python -m infra.tiny_models build --items 120`
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def items():
    return recall_items(N_ITEMS, HELDOUT_SEED)


@pytest.fixture(scope="module")
def root_recall(items):
    """Held-out recall of each GQA original the family derives from."""
    roots = sorted({_root_tiny(name) for name in MLA_MODELS})
    return {root: evaluate_recall(*load_tiny_model(root, progress=False), items)["overall"] for root in roots}


@pytest.fixture(scope="module")
def family():
    """Every member built (or loaded from the cache) once per module: name -> (model, tokenizer, build json)."""
    out = {}
    for name in MLA_MODELS:
        build = json.loads((ensure_mla_model(name, progress=False) / BUILD_FILE).read_text())
        out[name] = (*load_mla_model(name, progress=False), build)
    return out


@pytest.mark.parametrize("name", sorted(MLA_MODELS))
def test_recall_within_tolerance_of_the_gqa_original(family, root_recall, items, name):
    model, tokenizer, _ = family[name]
    score = evaluate_recall(model, tokenizer, items)["overall"]
    original = root_recall[_root_tiny(name)]
    assert score >= original - TOLERANCE, f"{name}: recall {score:.3f} vs {original:.3f} of {_root_tiny(name)}"


@pytest.mark.parametrize("name", sorted(MLA_MODELS))
def test_build_records_recipe_and_measurements(family, name):
    _, _, build = family[name]
    assert build["recipe_hash"] == recipe_hash(name)
    assert build["train_seconds"] > 0
    if "kl_converted" in build:  # MLA: distillation recovered the conversion's loss
        assert build["kl_distilled"] < 0.25 * build["kl_converted"]
    else:  # DSA: the warmed-up indexer ranks keys the way dense attention weighs them
        assert build["indexer_kl"] < build["indexer_kl_initial"]
        assert build["indexer_recall"] > 0.8


def test_architectures_and_sparse_selection(family, items):
    assert family["kvlingo-tiny-s-mla"][0].config.model_type == "deepseek_v3"
    assert family["kvlingo-tiny-l-mla"][0].config.model_type == "deepseek_v3"
    dsa, tokenizer, _ = family["kvlingo-tiny-s-dsa"]
    assert dsa.config.model_type == "deepseek_v32"
    lengths = [len(tokenizer(render_chat(i.messages, add_generation_prompt=True))["input_ids"]) for i in items]
    # The recall prompts are mostly longer than index_topk, so the indexer's choice decides the answers.
    assert sum(n > dsa.config.index_topk for n in lengths) > 0.9 * len(lengths)


@pytest.mark.parametrize("name", sorted(MLA_MODELS))
def test_zoo_loads_the_family(name):
    from infra.zoo import load_model

    loaded = load_model(name, device="cpu")
    assert loaded.identity["recipe_hash"] == recipe_hash(name)
