"""Integration tests of the embedded Gated DeltaNet hybrids (derives them on first run, minutes on CPU).

Builds into the real ``$KVLINGO_HOME/models`` cache (after the tiny GQA pair they derive from), so later runs
reuse them. Recall is scored on the held-out items the tiny-model build CLI uses.
"""

from __future__ import annotations

import json

import pytest
import torch

from infra.gdn_models import GDN_MODELS, LINEAR, ensure_gdn_model, load_gdn_model, recipe_hash, spec_for
from infra.synthetic_chat import recall_items
from infra.tiny_models import BUILD_FILE, HELDOUT_SEED, evaluate_recall, load_tiny_model
from translators.layout import RecurrentState, cache_layout
from translators.roundtrip import roundtrip

pytestmark = pytest.mark.integration

N_ITEMS = 60  # `python -m infra.gdn_models build --items 60`
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def items():
    return recall_items(N_ITEMS, HELDOUT_SEED)


@pytest.fixture(scope="module")
def family():
    """Every member built (or loaded from the cache) once per module: name -> (model, tokenizer, build json)."""
    out = {}
    for name in GDN_MODELS:
        build = json.loads((ensure_gdn_model(name, progress=False) / BUILD_FILE).read_text())
        out[name] = (*load_gdn_model(name, progress=False), build)
    return out


@pytest.mark.parametrize("name", sorted(GDN_MODELS))
def test_recall_within_tolerance_of_the_gqa_original(family, items, name):
    model, tokenizer, _ = family[name]
    parent = spec_for(name).parent
    original = evaluate_recall(*load_tiny_model(parent, progress=False), items)["overall"]
    score = evaluate_recall(model, tokenizer, items)["overall"]
    assert score >= original - TOLERANCE, f"{name}: recall {score:.3f} vs {original:.3f} of {parent}"


@pytest.mark.parametrize("name", sorted(GDN_MODELS))
def test_build_is_exact_outside_the_mixers_and_distillation_recovers(family, name):
    model, _, build = family[name]
    assert build["recipe_hash"] == recipe_hash(name)
    assert build["transfer_max_abs_logit_diff"] < 1e-4
    assert build["kl_distilled"] < 0.1 * build["kl_converted"]
    assert model.config.model_type == "qwen3_5_text"
    assert [t == LINEAR for t in model.config.layer_types] == [t == LINEAR for t in spec_for(name).layer_types]


def test_family_shares_one_state_geometry(family):
    shapes = set()
    for model, _, _ in family.values():
        layout = cache_layout(model)
        shapes |= {(layer.object_of(RecurrentState).shape) for layer in layout.layers if layer.attention == "linear"}
    assert shapes == {(4, 32, 32)}


@pytest.mark.parametrize("name", sorted(GDN_MODELS))
def test_doctor_round_trip_of_every_object(family, name):
    model, tokenizer, _ = family[name]
    ids = tokenizer("<|im_start|>user\nThe access code is 7314. Remember it.<|im_end|>\n<|im_start|>assistant\n",
                    return_tensors="pt").input_ids[0]
    for point in ("pre_norm", "post_norm", "post_rope"):
        result = roundtrip(model, cache_layout(model), ids, point)
        assert result.max_abs_logit_diff <= 1e-4 and result.grad_ok, (point, result)


@pytest.mark.parametrize("name", sorted(GDN_MODELS))
def test_zoo_loads_the_family(name):
    from infra.zoo import load_model

    loaded = load_model(name, device="cpu")
    assert loaded.identity["recipe_hash"] == recipe_hash(name)
    assert loaded.layout.attention_types.count("linear") == spec_for(name).layer_types.count(LINEAR)
    assert torch.isfinite(loaded.model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
