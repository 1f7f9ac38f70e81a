"""Unit tests of the embedded KDA hybrid's derivation, on a tiny random-init DeepSeek-V3 (MLA) parent."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infra import kda_models, mla_models
from infra.kda_models import FULL, LINEAR, KDASpec, convert_mla_to_kda, recipe_hash, spec_for, trainable_parameters
from tiny_configs import tiny_mla_model
from translators.errors import ConfigError
from translators.layout import MLALatent, cache_layout


@pytest.fixture(scope="module")
def parent():
    return tiny_mla_model("deepseek_v3", tie_word_embeddings=True)  # 3 layers, latent 32, rotary key 8


def _spec(layer_types=(LINEAR, LINEAR, FULL)):
    return KDASpec(layer_types=tuple(layer_types), linear_num_heads=2, linear_head_dim=8)


def test_conversion_keeps_every_weight_but_the_linear_layers_mixers(parent):
    torch.manual_seed(0)
    hybrid = convert_mla_to_kda(parent, _spec())
    layout = cache_layout(hybrid)
    assert layout.attention_types == ["linear", "linear", "global"]
    assert layout.layers[2].object_of(MLALatent).rotary is False  # Kimi-Linear's MLA is NoPE
    parent_state, hybrid_state = parent.state_dict(), hybrid.state_dict()
    kept = [k for k in hybrid_state if not (k.startswith(("model.layers.0.self_attn", "model.layers.1.self_attn")))]
    assert all(torch.equal(hybrid_state[k], parent_state[k]) for k in kept if k != "lm_head.weight")
    assert torch.equal(hybrid.lm_head.weight, parent.model.embed_tokens.weight)  # copied: Kimi-Linear never ties
    assert hybrid.lm_head.weight.data_ptr() != hybrid.model.embed_tokens.weight.data_ptr()
    # Without RoPE the one attention layer computes something else, so the converted model differs from its parent.
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hybrid(input_ids=ids).logits - parent(input_ids=ids).logits).abs().max() > 1e-3
    trained = {id(p) for p in trainable_parameters(hybrid)}
    assert trained == {id(p) for layer in hybrid.model.layers for p in layer.self_attn.parameters()}
    assert not trained & {id(p) for p in hybrid.model.embed_tokens.parameters()}


def test_layer_types_must_cover_every_parent_layer(parent):
    with pytest.raises(ConfigError, match="for each of the 3 parent layers"):
        convert_mla_to_kda(parent, _spec((LINEAR, FULL)))


def test_a_parent_with_moe_layers_is_refused():
    moe = tiny_mla_model("deepseek_v3", first_k_dense_replace=1)
    with pytest.raises(ConfigError, match="dense MLPs in every layer"):
        convert_mla_to_kda(moe, _spec())


def test_recipe_hash_pins_the_spec_and_the_parent(monkeypatch):
    before = recipe_hash(kda_models.NAME)
    with monkeypatch.context() as patch:
        patch.setitem(kda_models.KDA_MODELS, kda_models.NAME, dataclasses.replace(spec_for(kda_models.NAME), kl_steps=1))
        assert recipe_hash(kda_models.NAME) != before
    assert recipe_hash(kda_models.NAME) == before
    monkeypatch.setattr(mla_models, "recipe_hash", lambda parent: "a rebuilt parent")
    assert recipe_hash(kda_models.NAME) != before


def test_unknown_name_is_refused():
    with pytest.raises(ConfigError, match="known: \\['kvlingo-tiny-kda'\\]"):
        spec_for("kvlingo-tiny-kdb")


def test_training_chunk_length_changes_neither_outputs_nor_gradients_beyond_fp32_rounding(parent):
    # The build trains with 16-token chunks (three times faster here) and the model then runs with transformers'
    # 64: the chunked delta rule must be the same function either way, and the kwarg must reach the kernel.
    torch.manual_seed(0)
    hybrid = convert_mla_to_kda(parent, _spec())
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(1))  # 100: not a chunk multiple
    params = trainable_parameters(hybrid)
    for p in params:
        p.requires_grad_(True)
    results = {}
    for chunk in (64, 16):
        logits = hybrid(input_ids=ids, use_cache=False, chunk_size=chunk).logits
        grads = torch.autograd.grad(logits.pow(2).mean(), params)
        results[chunk] = (logits.detach(), torch.cat([g.flatten() for g in grads]))
    (logits_64, grads_64), (logits_16, grads_16) = results[64], results[16]
    assert (logits_16 - logits_64).abs().max() < 1e-4 * logits_64.abs().max()
    assert (grads_16 - grads_64).norm() < 1e-4 * grads_64.norm()
    assert not torch.equal(logits_16, logits_64)  # the chunk length reached the kernel (rounding differs)
    assert spec_for(kda_models.NAME).train_chunk_size == 16
