"""Stage 1 on tiny random models, against independent references (the native prefill)."""

import pytest
import torch
from tiny_configs import tiny_model

from translators.errors import ConfigError, NonFiniteError
from translators.layout import cache_layout
from translators.stage1 import (
    Side,
    accumulate_pair,
    assign_layers,
    candidate_layers,
    empty_stats,
    heldout_r2,
    random_like,
    solve_translator,
    validation_kl,
)


def prefixes(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def qwen():
    model = tiny_model("qwen3")
    return Side(model, cache_layout(model))


@pytest.mark.parametrize("method", ["depth", "greedy", "r2"])
def test_self_translation_recovers_identity_and_native_predictions(qwen, method):
    # A model translated into itself: the exact answer is the identity on the counterpart layer, and decoding
    # from the translated cache must then reproduce the native prefill (KL ≈ 0) — an independent reference.
    candidates = candidate_layers(qwen.layout, qwen.layout, method, 1)
    stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen, prefixes(12), "pre_norm")
    assignment = assign_layers(stats, qwen.layout, qwen.layout, method, 1)
    assert all(assignment[side][t] == (t,) for side in ("keys", "values") for t in range(3))
    translator = solve_translator(stats, assignment, qwen.layout, qwen.layout, "pre_norm")
    torch.testing.assert_close(translator.weight("keys", 1), torch.eye(32), atol=1e-4, rtol=0)
    val = [(p, c) for p, c in zip(prefixes(3, seed=1), prefixes(3, length=6, seed=2))]
    val_stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen, [p for p, _ in val], "pre_norm")
    r2 = heldout_r2(val_stats, translator)
    assert min(r2["keys"] + r2["values"]) > 0.9999
    kl = validation_kl(qwen, qwen, val, translator)
    assert kl.mean < 1e-6 and kl.n == 3
    # Controls on the same items are far worse.
    assert validation_kl(qwen, qwen, val, random_like(translator)).mean > 100 * max(kl.mean, 1e-6)
    assert validation_kl(qwen, qwen, val, None, condition="empty_prefix").mean > 1e-3


def test_cross_depth_pair_uses_relative_depth_band():
    src_model, tgt_model = tiny_model("qwen3", seed=1), tiny_model("gemma3", seed=2)
    src, tgt = Side(src_model, cache_layout(src_model)), Side(tgt_model, cache_layout(tgt_model))
    with pytest.raises(ConfigError, match="global"):
        # The source has no sliding layers: Gemma's sliding layers have no same-type counterpart.
        candidate_layers(src.layout, tgt.layout, "depth", 1)


def test_bad_inputs(qwen):
    with pytest.raises(ConfigError, match="did you mean 'greedy'"):
        candidate_layers(qwen.layout, qwen.layout, "gredy", 1)
    with pytest.raises(ConfigError, match="4"):
        candidate_layers(qwen.layout, qwen.layout, "r2", 4)
    with pytest.raises(ConfigError, match="empty validation set"):
        validation_kl(qwen, qwen, [], None)


def test_nan_in_capture_names_model_and_layer(qwen):
    model = tiny_model("llama")
    layout = cache_layout(model)
    bad = Side(model, layout)
    with torch.no_grad():
        model.get_decoder().layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    stats = empty_stats(layout, layout, candidate_layers(layout, layout, "depth", 1))
    with pytest.raises(NonFiniteError, match="source: NaN/Inf in layer 1 values"):
        accumulate_pair(stats, bad, bad, prefixes(1), "pre_norm")
