"""Kimi-Linear hybrids (Kimi Delta Attention + NoPE MLA): layout, state adapters, capture, replay and the bilinear
read metric (the round trip and the states' effect are tested with the GDN hybrid in test_gdn_objects)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import tiny_kda_model
from translators.capture import capture_hybrid
from translators.layout import LINEAR, ConvWindow, MLALatent, RecurrentState, cache_layout, is_hybrid, linear_mixer
from translators.mla import rotate_rope_key, unrotate_rope_key
from translators.objects import LINEAR_STATE, MLA, layer_objects, object_names
from translators.replay import mixer_inputs, replay_mixer
from translators.states import read_metric

IDS = torch.randint(0, 95, (21,), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def model():
    return tiny_kda_model()


@pytest.fixture(scope="module")
def layout(model):
    return cache_layout(model)


def test_layout_holds_kda_states_and_a_position_free_latent(model, layout):
    # 2 heads x 8, kernel 4 → one conv over q | k | v of 3 * 2 * 8 = 48 channels; the state is d x d per head.
    assert is_hybrid(layout) and layout.attention_types == [LINEAR, LINEAR, "global"]
    for i in (0, 1):
        assert layout.layers[i].objects == (RecurrentState(n_heads=2, key_dim=8, value_dim=8),
                                            ConvWindow(channels=48, kernel=4))
        assert layer_objects(layout, i) == LINEAR_STATE
        assert linear_mixer(model.model.layers[i]) is model.model.layers[i].self_attn
    assert linear_mixer(model.model.layers[2]) is None
    latent = layout.layers[2].object_of(MLALatent)
    assert (latent.kv_lora_rank, latent.rope_dim, latent.rotary, latent.rope) == (32, 8, False, ())
    assert layer_objects(layout, 2) == MLA
    assert object_names(layout) == ("conv_window", "recurrent_state", "latent", "rope_key")


def test_capture_matches_the_engine_and_the_nope_key_is_never_rotated(model, layout):
    with torch.no_grad():
        cap = capture_hybrid(model, layout, IDS, "post_rope")
        engine = model(input_ids=IDS.view(1, -1), use_cache=True).cache
    for i in (0, 1):
        assert torch.equal(cap.states["recurrent_state"][i], engine.get_recurrent_state(i))
        assert torch.equal(cap.states["conv_window"][i], engine.get_conv_state(i))
    assert cap.states["recurrent_state"][0].dtype == torch.float32 and cap.states["conv_window"][0].shape == (1, 48, 4)
    # What the engine stores as the MLA layer's (keys, values): the normed latent and the projected shared key.
    assert torch.allclose(cap.tokens["latent"][2], engine.layers[2].keys[0, 0], atol=1e-6)
    assert torch.allclose(cap.tokens["rope_key"][2], engine.layers[2].values[0, 0], atol=1e-6)
    positions = torch.arange(len(IDS)) * 3 + 5
    key = cap.tokens["rope_key"][2]
    assert torch.equal(rotate_rope_key(model, layout, 2, key, positions), key)
    assert torch.equal(unrotate_rope_key(model, layout, 2, key, positions), key)


def test_replaying_the_native_inputs_gives_the_native_state_exactly(model, layout):
    inputs = mixer_inputs(model, [0, 1], IDS)
    with torch.no_grad():
        engine = model(input_ids=IDS.view(1, -1), use_cache=True).cache
        for i in (0, 1):
            conv, state = replay_mixer(model, i, inputs[i])
            assert torch.equal(conv, engine.get_conv_state(i)) and torch.equal(state, engine.get_recurrent_state(i))


def test_read_metric_is_the_second_moment_of_normalised_queries_and_keys(model, layout):
    """Against an independent recomputation from the module's own projections, conv and SiLU."""
    import torch.nn.functional as F

    metric = read_metric(model, layout, [IDS])
    mixer = model.model.layers[1].self_attn
    x = mixer_inputs(model, [1], IDS)[1]  # [n, hidden]
    qkv = torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1).T.unsqueeze(0)  # [1, 48, n]
    conv = F.silu(F.conv1d(F.pad(qkv, (3, 0)), mixer.conv1d.weight, groups=48))[0].T  # [n, 48]
    q = F.normalize(conv[:, :16].reshape(-1, 2, 8).double(), dim=-1)
    k = F.normalize(conv[:, 16:32].reshape(-1, 2, 8).double(), dim=-1)
    expected = (torch.einsum("nhi,nhj->hij", q, q) + torch.einsum("nhi,nhj->hij", k, k)) / len(IDS)
    assert metric[1].shape == (2, 8, 8) and torch.allclose(metric[1], expected, atol=1e-10)
