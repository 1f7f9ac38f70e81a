"""Hybrid caches (Gated DeltaNet + attention, Qwen3.5; the round trip also on Kimi-Linear): layout, state adapters,
capture, injection, round trip."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import tiny_gdn_model, tiny_kda_model
from translators.capture import capture_hybrid
from translators.errors import ConfigError, UnsupportedModelError
from translators.inject import decode_step, write_hybrid_cache
from translators.layout import LINEAR, AttentionKV, ConvWindow, RecurrentState, cache_layout, is_hybrid
from translators.objects import CONV_WINDOW, LINEAR_STATE, RECURRENT_STATE, cache_objects, layer_objects, object_names
from translators.points import CAPTURE_POINTS
from translators.roundtrip import engine_next_logits, roundtrip

IDS = torch.randint(0, 95, (19,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def model():
    return tiny_gdn_model()


@pytest.fixture(scope="module")
def layout(model):
    return cache_layout(model)


def test_layout_holds_states_in_linear_layers_and_kv_in_attention_layers(layout):
    # tiny config: 1 key head x 8, 2 value heads x 12, kernel 4 → conv channels 2*1*8 + 2*12 = 40.
    assert is_hybrid(layout)
    assert layout.attention_types == [LINEAR, LINEAR, "global"]
    for i in (0, 1):
        assert layout.layers[i].objects == (RecurrentState(n_heads=2, key_dim=8, value_dim=12),
                                             ConvWindow(channels=40, kernel=4))
        assert layer_objects(layout, i) == LINEAR_STATE
    assert isinstance(layout.layers[2].objects[0], AttentionKV) and layout.layers[2].kv.width == 2 * 16
    assert object_names(layout) == ("conv_window", "recurrent_state", "keys", "values")
    signature = layout.signature()["layers"][0]
    assert signature["attention"] == LINEAR and signature["objects"][0]["kind"] == "recurrent_state"


def test_uniform_entry_point_refuses_a_hybrid_with_a_pointer(layout):
    with pytest.raises(UnsupportedModelError, match="hybrid"):
        cache_objects(layout)


def test_capture_reads_the_engine_states_and_the_conv_inputs(model, layout):
    conv_inputs = {}

    def keep(_module, _inputs, output):
        conv_inputs["x"] = output[0]  # [n_tokens, C]

    handle = model.model.layers[1].linear_attn.in_proj_qkv.register_forward_hook(keep)
    try:
        with torch.no_grad():
            cap = capture_hybrid(model, layout, IDS)
            engine = model(input_ids=IDS.view(1, -1), use_cache=True).cache
    finally:
        handle.remove()
    assert set(cap.states) == {"conv_window", "recurrent_state"} and set(cap.states["conv_window"]) == {0, 1}
    assert set(cap.tokens) == {"keys", "values"} and set(cap.tokens["keys"]) == {2}
    assert cap.states["recurrent_state"][0].shape == (1, 2, 8, 12)
    assert cap.states["conv_window"][1].shape == (1, 40, 4)
    for i in (0, 1):
        assert torch.equal(cap.states["recurrent_state"][i], engine.get_recurrent_state(i))
        assert torch.equal(cap.states["conv_window"][i], engine.get_conv_state(i))
    # The window is the conv's last K inputs (pre-conv q|k|v projections), oldest first.
    assert torch.allclose(cap.states["conv_window"][1][0], conv_inputs["x"][-4:].T)
    assert cap.tokens["keys"][2].shape == (19, 32)


@pytest.fixture(scope="module", params=["gdn", "kda"])
def hybrid(request):
    """Each supported linear-attention family: Qwen3.5 (Gated DeltaNet) and Kimi-Linear (KDA + NoPE MLA)."""
    model = tiny_gdn_model() if request.param == "gdn" else tiny_kda_model()
    return model, cache_layout(model)


@pytest.mark.parametrize("point", CAPTURE_POINTS)
def test_round_trip_reproduces_native_logits_and_grads_reach_every_state(hybrid, point):
    model, layout = hybrid
    result = roundtrip(model, layout, IDS, point)
    assert result.max_abs_logit_diff <= 1e-4
    assert result.grad_ok and result.layers_without_grad == ()


def test_states_carry_the_prompt(hybrid):
    """Zeroing the linear layers' states moves the next-token logits far more than the round trip's error."""
    model, layout = hybrid
    with torch.no_grad():
        cap = capture_hybrid(model, layout, IDS[:-1])
        native = engine_next_logits(model, IDS)
        zero = {name: {i: torch.zeros_like(x) for i, x in xs.items()} for name, xs in cap.states.items()}
        logits = decode_step(model, write_hybrid_cache(model, layout, cap.tokens, zero, point="pre_norm"), IDS[-1:])[-1]
    assert (logits - native).abs().max() > 1e-2


def test_injected_state_is_not_modified_and_trains_over_several_steps(model, layout):
    """The engine updates states in place; the written state must stay as given, and backward must pass through
    two decoding steps (transformers' in-place update_recurrent_state alone raises here)."""
    with torch.no_grad():
        cap = capture_hybrid(model, layout, IDS[:-3])
    states = {name: {i: x.clone().requires_grad_(True) for i, x in xs.items()} for name, xs in cap.states.items()}
    before = {name: {i: x.detach().clone() for i, x in xs.items()} for name, xs in states.items()}
    cache = write_hybrid_cache(model, layout, cap.tokens, states, point="pre_norm")
    first = decode_step(model, cache, IDS[-3:-2])
    second = decode_step(model, cache, IDS[-2:-1])
    (first.square().sum() + second.square().sum()).backward()
    for name, xs in states.items():
        for i, x in xs.items():
            assert torch.equal(x.detach(), before[name][i])
            assert x.grad is not None and x.grad.abs().sum() > 0


def test_write_refuses_missing_and_misshapen_states(model, layout):
    with torch.no_grad():
        cap = capture_hybrid(model, layout, IDS)
    partial = {"conv_window": cap.states["conv_window"], "recurrent_state": {0: cap.states["recurrent_state"][0]}}
    with pytest.raises(ConfigError, match=r"missing recurrent_state@1"):
        write_hybrid_cache(model, layout, cap.tokens, partial, point="pre_norm")
    wrong = {**cap.states, "recurrent_state": {0: cap.states["recurrent_state"][0],
                                               1: cap.states["recurrent_state"][1].transpose(-1, -2)}}
    with pytest.raises(ConfigError, match=r"layer 1: recurrent_state must have shape \[1, 2, 8, 12\]"):
        write_hybrid_cache(model, layout, cap.tokens, wrong, point="pre_norm")


def test_capture_refuses_a_batch_of_conversations(model, layout):
    with pytest.raises(ConfigError, match="one conversation at a time"):
        capture_hybrid(model, layout, IDS.view(1, -1).repeat(2, 1))


def test_state_written_before_conv_window_is_refused(model):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with pytest.raises(ConfigError, match="conv window before the recurrent state"):
        RECURRENT_STATE.write(cache, 0, torch.zeros(1, 2, 8, 12))
    CONV_WINDOW.write(cache, 0, torch.ones(1, 40, 4))
    RECURRENT_STATE.write(cache, 0, torch.ones(1, 2, 8, 12))
    assert torch.equal(RECURRENT_STATE.read(cache, 0), torch.ones(1, 2, 8, 12))
    assert torch.equal(CONV_WINDOW.read(cache, 0), torch.ones(1, 40, 4))


def test_doctor_cli_round_trips_a_hybrid_directory(tmp_path):
    import json

    from tiny_configs import tiny_tokenizer, words
    from typer.testing import CliRunner

    from flows.cli import app

    tiny_gdn_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    result = CliRunner().invoke(app, ["doctor", str(tmp_path), "--prompt", words(20), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["objects"] == ["conv_window", "recurrent_state", "keys", "values"]
    assert all(row["max_abs_logit_diff"] <= 1e-4 and row["grad_ok"] for row in report["points"].values())
