"""Unit tests of the embedded GDN hybrids' derivation, on tiny random-init Qwen3 models built from configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infra import gdn_models, tiny_models
from infra.gdn_models import FULL, LINEAR, GDNSpec, convert_qwen3_to_gdn, mixer_parameters, recipe_hash, spec_for
from tiny_configs import tiny_model
from translators.capture import check_unpacked
from translators.errors import ConfigError
from translators.layout import cache_layout


@pytest.fixture(scope="module")
def parent():
    return tiny_model("qwen3", tie_word_embeddings=True)  # 3 layers, 2 KV heads, head_dim 16


def _spec(layer_types, **overrides):
    geometry = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    return GDNSpec(parent="kvlingo-tiny-s", layer_types=tuple(layer_types), **{**geometry, **overrides})


def test_all_attention_conversion_reproduces_the_parent_exactly(parent):
    """Zero-centred norms, the zero output gate with doubled o_proj and full RoPE reproduce Qwen3 attention."""
    converted = convert_qwen3_to_gdn(parent, _spec((FULL, FULL, FULL)))
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (converted(input_ids=ids).logits - parent(input_ids=ids).logits).abs().max()
    assert diff < 1e-4
    # The hybrid declares the spec's context, not the parent's; the declaration does not enter the computation.
    assert parent.config.max_position_embeddings != 8192
    assert cache_layout(converted).max_positions == GDNSpec.max_position_embeddings == 8192


def test_hybrid_conversion_replaces_only_the_linear_layers_mixers(parent):
    torch.manual_seed(0)
    hybrid = convert_qwen3_to_gdn(parent, _spec((LINEAR, LINEAR, FULL)))
    layout = cache_layout(hybrid)
    assert layout.attention_types == ["linear", "linear", "global"]
    assert torch.equal(hybrid.model.layers[2].self_attn.k_proj.weight, parent.model.layers[2].self_attn.k_proj.weight)
    assert torch.equal(hybrid.model.layers[0].mlp.up_proj.weight, parent.model.layers[0].mlp.up_proj.weight)
    assert torch.allclose(hybrid.model.layers[1].input_layernorm.weight + 1,
                          parent.model.layers[1].input_layernorm.weight)
    assert hybrid.lm_head.weight.data_ptr() == hybrid.model.embed_tokens.weight.data_ptr()  # tied like the parent
    trained = {id(p) for p in mixer_parameters(hybrid)}
    assert trained == {id(p) for i in (0, 1) for p in hybrid.model.layers[i].linear_attn.parameters()}


def test_layer_types_must_cover_every_parent_layer(parent):
    with pytest.raises(ConfigError, match="for each of the 3 source layers"):
        convert_qwen3_to_gdn(parent, _spec((LINEAR, FULL)))
    with pytest.raises(ConfigError, match="for each of the 3 source layers"):
        convert_qwen3_to_gdn(parent, _spec((LINEAR, "sliding_attention", FULL)))


def test_rows_hold_one_conversation_each():
    tokenizer = tiny_models._train_tokenizer()
    rows = gdn_models.conversation_rows(tokenizer, 6, seed=5, max_tokens=512)
    end = tokenizer.convert_tokens_to_ids(tiny_models.ENDOFTEXT)
    for r in range(6):
        n = int(rows["lengths"][r])
        real = rows["input_ids"][r, :n]
        assert int((real == end).sum()) == 1 and int(real[-1]) == end  # one conversation, then its end
        assert bool((rows["input_ids"][r, n:] == end).all()) and not rows["weights"][r, n:].any()
        assert rows["copies"][r, :n].sum() > 0  # answers copy values from the conversation


def test_packed_rows_are_refused_with_the_reason():
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # row 0: two conversations
    with pytest.raises(ConfigError, match="row 0 restarts its positions at token 3: it packs several conversations"):
        check_unpacked(packed)
    check_unpacked(torch.arange(7).repeat(3, 1))
    check_unpacked(None)
    rows = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "position_ids": packed, "weights": torch.ones(2, 5),
            "copies": torch.zeros(2, 5), "lengths": torch.tensor([5, 5])}
    with pytest.raises(ConfigError, match="recurrent state would carry"):
        gdn_models._batch(rows, 0, 2)


def test_recipe_hash_pins_the_spec_and_the_parent(monkeypatch):
    name = "kvlingo-tiny-s-gdn"
    before = recipe_hash(name)
    assert recipe_hash("kvlingo-tiny-l-gdn") != before
    with monkeypatch.context() as patch:
        patch.setitem(gdn_models.GDN_MODELS, name, dataclasses.replace(spec_for(name), kl_steps=601))
        assert recipe_hash(name) != before
    assert recipe_hash(name) == before
    monkeypatch.setattr(tiny_models, "recipe_hash", lambda parent: "a rebuilt parent")
    assert recipe_hash(name) != before


def test_unknown_name_suggests_the_nearest():
    with pytest.raises(ConfigError, match="Did you mean 'kvlingo-tiny-s-gdn'"):
        spec_for("kvlingo-tiny-s-gnd")


def test_family_members_share_one_state_geometry():
    geometry = {(s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
                 s.linear_conv_kernel_dim) for s in gdn_models.GDN_MODELS.values()}
    assert len(geometry) == 1
    assert all(s.layer_types[-1] == FULL for s in gdn_models.GDN_MODELS.values())  # the copy-head layer stays


def test_grown_mixers_keep_the_function_and_the_states(parent):
    """A hybrid grown from a narrower one (mixers grown into the Net2Net-grown parent) computes the same function
    and holds the same states in the layers that grew from each other: consecutive generations of one model."""
    from transformers import Qwen3Config

    from translators.capture import capture_hybrid

    torch.manual_seed(1)
    small = convert_qwen3_to_gdn(parent, _spec((LINEAR, LINEAR, FULL)))
    config = Qwen3Config(**{**parent.config.to_dict(), "hidden_size": 96, "intermediate_size": 128,
                            "num_hidden_layers": 5, "num_attention_heads": 4, "layer_types": None})
    grown_parent = tiny_models.grow_qwen3(parent, config).eval()
    large = convert_qwen3_to_gdn(grown_parent, _spec((LINEAR, FULL, LINEAR, FULL, FULL)))
    assert gdn_models.grow_mixers(large, small) == {0: 0, 2: 1}  # growth placed parent layers 0, 1, 2 at 0, 2, 4
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (large(input_ids=ids).logits - small(input_ids=ids).logits).abs().max() < 1e-4
        small_states = capture_hybrid(small, cache_layout(small), ids[0]).states["recurrent_state"]
        large_states = capture_hybrid(large, cache_layout(large), ids[0]).states["recurrent_state"]
    assert torch.allclose(large_states[2], small_states[1], atol=1e-5)
    with pytest.raises(ConfigError, match="geometry differs"):
        gdn_models.grow_mixers(convert_qwen3_to_gdn(grown_parent, _spec((LINEAR,) * 5, linear_key_head_dim=16)), small)


def test_training_runs_on_one_thread_and_restores_the_callers_thread_count():
    weight = torch.nn.Parameter(torch.ones(3))
    seen = []

    def loss_of(batch):
        seen.append(torch.get_num_threads())
        if len(seen) == 3:
            return weight.sum() * float("nan")  # a failing step must restore the thread count too
        return (weight * batch["input_ids"][:, :1].float().sum()).pow(2).sum()

    rows = {"input_ids": torch.ones(4, 5, dtype=torch.long), "weights": torch.ones(4, 5), "copies": torch.zeros(4, 5),
            "lengths": torch.full((4,), 5)}
    spec = _spec((LINEAR, LINEAR, FULL))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="non-finite loss at step 2"):
            gdn_models._train([weight], loss_of, rows, 5, spec, 1e-3, progress=False, description="t")
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
