"""State strategies for hybrid targets: zero, copy, copy + closed-form bilinear correction (paper 004 §3.5)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import tiny_gdn_model
from translators.capture import capture_hybrid
from translators.continuation import cache_logits, kl_per_position, teacher_logits
from translators.errors import ConfigError
from translators.inject import write_hybrid_cache
from translators.layout import cache_layout
from translators.states import (
    CONV,
    COPY,
    CORRECTED,
    STATE,
    ZERO,
    StateMaps,
    assign_linear_layers,
    fit_bilinear,
    fit_conv_affine,
    fit_corrections,
    relative_error,
)

L, F = "linear_attention", "full_attention"


def _layout(layer_types, **overrides):
    return cache_layout(tiny_gdn_model(num_hidden_layers=len(layer_types), layer_types=list(layer_types), **overrides))


@pytest.fixture(scope="module")
def model():
    return tiny_gdn_model()


@pytest.fixture(scope="module")
def layout(model):
    return cache_layout(model)


def _ids(n, seed):
    return torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(seed))


def test_linear_layers_are_assigned_by_relative_depth_among_linear_layers():
    small, large = _layout((L, L, L, F)), _layout((L, L, F, L, L, F))
    assert assign_linear_layers(small, large) == {0: 0, 1: 1, 3: 1, 4: 2}
    assert assign_linear_layers(large, small) == {0: 0, 1: 3, 2: 4}


def test_copy_needs_a_source_state_and_the_same_geometry(layout):
    attention_only = _layout((F, F))
    with pytest.raises(ConfigError, match="no linear-attention layer, so there is no state to copy"):
        StateMaps(attention_only, layout, {0: COPY, 1: ZERO})
    StateMaps(attention_only, layout, {0: ZERO, 1: ZERO})  # zero needs no source state
    wider = _layout((L, L, F), linear_value_head_dim=16)
    with pytest.raises(ConfigError, match=r"target layer 0 holds a recurrent_state of shape \[2, 8, 12\] but its "
                                          r"source layer 0 holds \[2, 8, 16\]"):
        StateMaps(wider, layout, {0: COPY, 1: COPY})
    with pytest.raises(ConfigError, match=r"unknown state strategy .mean. \(choose from zero, copy, copy_corrected, replay\)"):
        StateMaps(layout, layout, {0: "mean", 1: COPY})
    with pytest.raises(ConfigError, match=r"for each target linear layer \[0, 1\]"):
        StateMaps(layout, layout, {0: COPY})


def test_fit_bilinear_recovers_a_planted_per_head_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 2, 8, 12, generator=g, dtype=torch.float64)
    left = torch.eye(8) + 0.3 * torch.randn(2, 8, 8, generator=g, dtype=torch.float64)
    right = torch.eye(12) + 0.3 * torch.randn(2, 12, 12, generator=g, dtype=torch.float64)
    y = left @ x @ right
    errors = []
    for passes in (1, 2, 8):
        fl, fr = fit_bilinear(x, y, ridge=1e-10, passes=passes)
        errors.append(relative_error(fl @ x @ fr, y))
    assert errors[0] >= errors[1] >= errors[2]  # alternating least squares never gets worse
    assert errors[2] < 1e-6 < relative_error(x, y)
    # A left-only map (R = I) is exact after one pass.
    fl, fr = fit_bilinear(x, left @ x, ridge=1e-10, passes=1)
    assert relative_error(fl @ x @ fr, left @ x) < 1e-10


def test_strong_ridge_shrinks_the_correction_to_plain_copy():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 2, 4, 5, generator=g), torch.randn(50, 2, 4, 5, generator=g)
    fl, fr = fit_bilinear(x, y, ridge=1e9)
    assert torch.allclose(fl, torch.eye(4, dtype=fl.dtype).expand(2, 4, 4), atol=1e-6)
    assert torch.allclose(fr, torch.eye(5, dtype=fr.dtype).expand(2, 5, 5), atol=1e-6)
    w, b = fit_conv_affine(x.flatten(1).unsqueeze(-1).repeat(1, 1, 3), y.flatten(1).unsqueeze(-1).repeat(1, 1, 3),
                           ridge=1e9)  # [50, 40, 3] windows
    assert torch.allclose(w, torch.eye(40, dtype=w.dtype), atol=1e-6)


def test_fit_conv_affine_recovers_a_planted_map():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 10, 4, generator=g, dtype=torch.float64)
    w0, b0 = torch.randn(10, 10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
    w, b = fit_conv_affine(x, torch.einsum("cd,ndk->nck", w0, x) + b0.view(1, -1, 1), ridge=1e-12)
    assert torch.allclose(w, w0, atol=1e-6) and torch.allclose(b, b0, atol=1e-6)


def test_strategies_produce_zero_copied_and_corrected_states(model, layout):
    with torch.no_grad():
        states = capture_hybrid(model, layout, _ids(12, 0)).states
    maps = StateMaps(layout, layout, {0: ZERO, 1: CORRECTED})
    left, right = 2 * torch.eye(8).repeat(2, 1, 1), torch.eye(12).repeat(2, 1, 1)
    maps.set_correction(1, left, right, 3 * torch.eye(40), torch.ones(40))
    out = maps(states)
    assert torch.equal(out[STATE][0], torch.zeros(1, 2, 8, 12)) and torch.equal(out[CONV][0], torch.zeros(1, 40, 4))
    assert torch.allclose(out[STATE][1], 2 * states[STATE][1])
    assert torch.allclose(out[CONV][1], 3 * states[CONV][1] + 1)
    copied = StateMaps(layout, layout, {0: COPY, 1: COPY})(states)
    assert copied[STATE][1] is states[STATE][1] and copied[CONV][0] is states[CONV][0]
    with pytest.raises(ConfigError, match="uses 'zero', not 'copy_corrected'"):
        maps.set_correction(0, left, right, torch.eye(40), torch.zeros(40))


def _logits(model, layout, maps, prefix, continuation):
    cap = capture_hybrid(model, layout, prefix[:-1])
    cache = write_hybrid_cache(model, layout, cap.tokens, maps(cap.states), point="pre_norm")
    return cache_logits(model, cache, prefix, continuation)


def test_self_copy_is_exact_and_self_correction_fits_the_identity(model, layout):
    prompts = [_ids(10 + i, 10 + i) for i in range(12)]
    with torch.no_grad():
        caps = [capture_hybrid(model, layout, p).states for p in prompts]
    maps = StateMaps(layout, layout, {0: CORRECTED, 1: COPY})
    fits = fit_corrections(maps, caps, caps, ridge=1e-6, n_heldout=3)
    assert [f.layer for f in fits] == [0] and fits[0].state_copy == 0.0 and fits[0].state_corrected < 1e-8
    assert fits[0].conv_corrected < 1e-8
    prefix, continuation = _ids(15, 99), _ids(4, 98)
    with torch.no_grad():
        kl = kl_per_position(teacher_logits(model, prefix, continuation),
                             _logits(model, layout, maps, prefix, continuation))
    assert kl.max() < 1e-6


def test_copy_beats_zero_between_two_close_models():
    """A perturbed copy of a model: its states, copied, carry the prompt far better than zero states."""
    target = tiny_gdn_model(seed=0)
    source = tiny_gdn_model(seed=0)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.02 * torch.randn_like(p))
    src_layout, tgt_layout = cache_layout(source), cache_layout(target)
    prefix, continuation = _ids(20, 5), _ids(6, 6)
    kls = {}
    with torch.no_grad():
        teacher = teacher_logits(target, prefix, continuation)
        for strategy in (ZERO, COPY):
            maps = StateMaps(src_layout, tgt_layout, {0: strategy, 1: strategy})
            src = capture_hybrid(source, src_layout, prefix[:-1])
            tgt = capture_hybrid(target, tgt_layout, prefix[:-1])  # the target's own attention K/V
            cache = write_hybrid_cache(target, tgt_layout, tgt.tokens, maps(src.states), point="pre_norm")
            kls[strategy] = kl_per_position(teacher, cache_logits(target, cache, prefix, continuation)).mean().item()
    assert kls[COPY] < 0.2 * kls[ZERO]


def test_gradients_reach_the_correction_through_the_frozen_target(model, layout):
    maps = StateMaps(layout, layout, {0: CORRECTED, 1: CORRECTED})
    prefix, continuation = _ids(14, 7), _ids(3, 8)
    with torch.no_grad():
        teacher = teacher_logits(model, prefix, continuation)
    with torch.no_grad():
        maps.maps["left_0"].mul_(1.5)
    kl_per_position(teacher, _logits(model, layout, maps, prefix, continuation)).mean().backward()
    for name, param in maps.maps.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_stage_two_lowers_the_kl_of_a_noisy_closed_form():
    """Distillation through the frozen hybrid target pulls perturbed K/V maps and state corrections back."""
    from translators.hybrid import HybridTranslator, distill_hybrid, hybrid_validation_kl

    model = tiny_gdn_model(seed=0)
    layout = cache_layout(model)
    translator = HybridTranslator(layout, layout, StateMaps(layout, layout, {0: CORRECTED, 1: CORRECTED}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in translator.kv.items():
            p.copy_(torch.eye(p.shape[0]) + 0.3 * torch.randn(p.shape, generator=g) / p.shape[0] ** 0.5)
        for name, p in translator.states.maps.items():
            p.add_(0.1 * torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)
    samples = [(_ids(10 + i % 5, 40 + i), _ids(3, 80 + i)) for i in range(8)]
    before = hybrid_validation_kl(model, layout, model, layout, samples, translator).mean
    losses = distill_hybrid(translator, model, layout, model, layout, samples, steps=40, lr=5e-3, batch=4)
    after = hybrid_validation_kl(model, layout, model, layout, samples, translator).mean
    assert len(losses) == 40 and after < 0.5 * before, (before, after)


def _keys_permuted(model, layer: int):
    """The same function with the key dimensions of layer's GDN heads permuted (query and key channels alike,
    conv weights with them; the conv is depthwise and SiLU elementwise, so the logits do not change), while that
    layer's state rows and conv window channels come out permuted: a copy is wrong, a left map undoes it."""
    import copy

    permuted = copy.deepcopy(model)
    attn = permuted.model.layers[layer].linear_attn
    perm = torch.randperm(attn.head_k_dim, generator=torch.Generator().manual_seed(0))
    index = torch.arange(attn.conv_dim)
    for block in (0, attn.key_dim):  # query channels, then key channels
        for head in range(attn.num_k_heads):
            start = block + head * attn.head_k_dim
            index[start:start + attn.head_k_dim] = start + perm
    with torch.no_grad():
        attn.in_proj_qkv.weight.copy_(attn.in_proj_qkv.weight[index])
        attn.conv1d.weight.copy_(attn.conv1d.weight[index])
    return permuted


def test_selection_keeps_a_correction_only_where_it_lowers_kl():
    from translators.hybrid import HybridTranslator, fit_kv_maps, fit_states, select_corrections

    target = tiny_gdn_model(seed=0)
    source = _keys_permuted(target, 0)
    layout = cache_layout(target)
    ids = _ids(16, 1).view(1, -1)
    with torch.no_grad():
        assert torch.allclose(source(input_ids=ids).logits, target(input_ids=ids).logits, atol=1e-4)
    prompts = [_ids(12 + i % 6, 200 + i) for i in range(30)]
    samples = [(_ids(12 + i % 4, 300 + i), _ids(4, 400 + i)) for i in range(6)]
    with torch.no_grad():
        src = [capture_hybrid(source, layout, p) for p in prompts]
        tgt = [capture_hybrid(target, layout, p) for p in prompts]
    corrected = HybridTranslator(layout, layout, StateMaps(layout, layout, {0: CORRECTED, 1: CORRECTED}))
    fit_kv_maps(corrected, src, tgt, ridge=1e-8)
    fits = fit_states(corrected, src, tgt, ridge=1e-8)
    assert fits[0].state_copy > 0.5 and fits[0].state_corrected < 1e-6  # layer 0: exactly a permutation to undo
    with torch.no_grad():  # spoil layer 1's correction (its states are identical: copy is exact there)
        corrected.states.maps["left_1"].mul_(2.0)
    selected, copy_kl, trace = select_corrections(source, layout, target, layout, corrected, samples)
    assert selected.states.strategies == {0: CORRECTED, 1: COPY}
    assert [trace[t]["strength"] for t in (0, 1)] == [1.0, 0.0]  # the exact fit whole, the spoiled one not at all
    assert copy_kl > 0.01 and trace[0]["kl"] < 1e-4 and trace[1]["kl"] == trace[0]["kl"]
    assert torch.allclose(selected.states.maps["left_0"], corrected.states.maps["left_0"], atol=1e-6)


def test_a_correction_at_half_strength_moves_each_factor_halfway_from_the_identity():
    from translators.hybrid import _correction_at_strength

    layout = cache_layout(tiny_gdn_model(seed=0))
    maps = StateMaps(layout, layout, {0: CORRECTED, 1: CORRECTED})
    g = torch.Generator().manual_seed(5)
    fitted = {name: torch.randn(p.shape, generator=g) for name, p in maps.maps.items() if name.endswith("_0")}
    maps.set_correction(0, *(fitted[f"{n}_0"] for n in ("left", "right", "conv_weight", "conv_bias")))
    left, right, weight, bias = _correction_at_strength(maps, 0, 0.5)
    heads, dk = left.shape[:2]
    assert torch.allclose(left, 0.5 * torch.eye(dk).repeat(heads, 1, 1) + 0.5 * fitted["left_0"])
    assert torch.allclose(right, 0.5 * torch.eye(right.shape[-1]) + 0.5 * fitted["right_0"])
    assert torch.allclose(weight, 0.5 * torch.eye(weight.shape[-1]) + 0.5 * fitted["conv_weight_0"])
    assert torch.allclose(bias, 0.5 * fitted["conv_bias_0"])
    copy = _correction_at_strength(maps, 0, 0.0)
    assert torch.equal(copy[0], torch.eye(dk).expand_as(left)) and torch.equal(copy[3], torch.zeros_like(bias))


def test_read_metric_is_the_second_moment_of_unit_queries_and_keys(model, layout):
    from translators.states import read_metric

    prompts = [_ids(9 + i, 500 + i) for i in range(4)]
    metrics = read_metric(model, layout, prompts)
    assert set(metrics) == {0, 1} and metrics[0].shape == (2, 8, 8) and metrics[0].dtype == torch.float64
    trace = metrics[1].diagonal(dim1=-2, dim2=-1).sum(-1)
    assert torch.allclose(trace, torch.full((2,), 2.0, dtype=torch.float64), atol=1e-4)  # |q̂|² + |k̂|² = 2
    assert torch.allclose(metrics[0], metrics[0].transpose(-1, -2))
    assert torch.linalg.eigvalsh(metrics[0]).min() > -1e-12
    assert torch.equal(metrics[0][0], metrics[0][1])  # one key head serves both value heads


def test_a_metric_weighs_which_rows_r_must_fit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 1, 4, 6, generator=g, dtype=torch.float64)
    right = torch.eye(6, dtype=torch.float64) + 0.5 * torch.randn(6, 6, generator=g, dtype=torch.float64)
    y = x @ right
    y[:, :, 3] = torch.randn(400, 1, 6, generator=g, dtype=torch.float64) * 10  # row 3: loud and unrelated
    fl, fr = fit_bilinear(x, y, ridge=1e-10, passes=10)  # R must compromise with row 3
    unread = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)).unsqueeze(0)
    wl, wr = fit_bilinear(x, y, ridge=1e-10, passes=10, metric=unread)  # row 3 is never read
    read_rows = slice(0, 3)
    assert relative_error((wl @ x @ wr)[:, :, read_rows], y[:, :, read_rows]) < 1e-6
    assert relative_error((fl @ x @ fr)[:, :, read_rows], y[:, :, read_rows]) > 1e-3
    same_l, same_r = fit_bilinear(x, y, ridge=1e-10, passes=10, metric=torch.eye(4, dtype=torch.float64)[None])
    assert torch.allclose(same_r, fr)
