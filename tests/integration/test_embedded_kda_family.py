"""Integration tests of the embedded Kimi-Linear hybrid ``kvlingo-tiny-kda`` (derived on first run from
kvlingo-tiny-s-mla, minutes on CPU), into the real ``$KVLINGO_HOME/models`` cache so later runs reuse it."""

from __future__ import annotations

import json

import pytest
import torch

from infra.kda_models import NAME, ensure_kda_model, load_kda_model, recipe_hash, spec_for
from infra.mla_models import load_mla_model
from infra.synthetic_chat import recall_items
from infra.tiny_models import BUILD_FILE, HELDOUT_SEED, evaluate_recall
from translators.layout import MLALatent, RecurrentState, cache_layout
from translators.points import CAPTURE_POINTS
from translators.roundtrip import roundtrip

pytestmark = pytest.mark.integration

N_ITEMS = 60
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def built():
    build = json.loads((ensure_kda_model(NAME, progress=False) / BUILD_FILE).read_text())
    return (*load_kda_model(NAME, progress=False), build)


def test_recall_within_tolerance_of_the_mla_original(built):
    model, tokenizer, _ = built
    items = recall_items(N_ITEMS, HELDOUT_SEED)
    original = evaluate_recall(*load_mla_model(spec_for(NAME).parent, progress=False), items)["overall"]
    score = evaluate_recall(model, tokenizer, items)["overall"]
    assert score >= original - TOLERANCE, f"recall {score:.3f} vs {original:.3f} of {spec_for(NAME).parent}"


def test_build_records_its_recipe_and_distillation_recovers(built):
    model, _, build = built
    assert build["recipe_hash"] == recipe_hash(NAME)
    assert build["kl_distilled"] < 0.1 * build["kl_converted"]
    layout = cache_layout(model)
    assert model.config.model_type == "kimi_linear"
    assert [layer.attention for layer in layout.layers] == ["linear", "linear", "linear", "global"]
    assert {layer.object_of(RecurrentState).shape for layer in layout.layers[:3]} == {(4, 32, 32)}
    assert layout.layers[3].object_of(MLALatent).rotary is False


@pytest.mark.parametrize("point", CAPTURE_POINTS)
def test_doctor_round_trip_of_every_object(built, point):
    model, tokenizer, _ = built
    ids = tokenizer("<|im_start|>user\nThe access code is 7314. Remember it.<|im_end|>\n<|im_start|>assistant\n",
                    return_tensors="pt").input_ids[0]
    result = roundtrip(model, cache_layout(model), ids, point)
    assert result.max_abs_logit_diff <= 1e-4 and result.grad_ok, result


def test_zoo_loads_it():
    from infra.zoo import load_model

    loaded = load_model(NAME, device="cpu")
    assert loaded.identity["recipe_hash"] == recipe_hash(NAME)
    assert torch.isfinite(loaded.model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
