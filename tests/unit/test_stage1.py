"""Stage 1 on tiny random models, against independent references (the native prefill)."""

import pytest
import torch
from tiny_configs import tiny_model

from translators.errors import ConfigError, NonFiniteError
from translators.layout import cache_layout
from translators.assignment import relative_depth
from translators.stage1 import (
    ReferenceMemo,
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
    train = [(p, p[-3:]) for p in prefixes(12)]
    stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen, train, "pre_norm")
    assignment = assign_layers(stats, qwen.layout, qwen.layout, method, 1)
    assert all(assignment[side][t] == (t,) for side in ("keys", "values") for t in range(3))
    translator = solve_translator(stats, assignment, qwen.layout, qwen.layout, "pre_norm")
    torch.testing.assert_close(translator.weight("keys", 1), torch.eye(32), atol=1e-4, rtol=0)
    val = [(p, c) for p, c in zip(prefixes(3, seed=1), prefixes(3, length=6, seed=2))]
    val_stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen, val, "pre_norm")
    r2 = heldout_r2(val_stats, translator)
    assert min(r2["keys"] + r2["values"]) > 0.9999
    kl = validation_kl(qwen, qwen, val, translator)
    assert kl.mean < 1e-6 and kl.n == 3
    # Controls on the same items are far worse.
    assert validation_kl(qwen, qwen, val, random_like(translator)).mean > 100 * max(kl.mean, 1e-6)
    assert validation_kl(qwen, qwen, val, None, condition="empty_prefix").mean > 1e-3


def _counting(function, name, calls):
    def counted(*args):
        calls.append(name)
        return function(*args)

    return counted


def test_reference_memo_scores_bit_identically_and_computes_each_reference_once(qwen, monkeypatch):
    import translators.stage1 as stage1

    candidates = candidate_layers(qwen.layout, qwen.layout, "depth", 1)
    stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen,
                            [(p, p[-3:]) for p in prefixes(8)], "pre_norm")
    fitted = solve_translator(stats, assign_layers(stats, qwen.layout, qwen.layout, "depth", 1), qwen.layout,
                              qwen.layout, "pre_norm")
    translators = [fitted, random_like(fitted)]
    val = [(p, c) for p, c in zip(prefixes(3, seed=1), prefixes(3, length=6, seed=2))]
    fresh = [validation_kl(qwen, qwen, val, t) for t in translators]
    calls = []
    monkeypatch.setattr(stage1, "teacher_logits", _counting(stage1.teacher_logits, "teacher", calls))
    monkeypatch.setattr(stage1, "capture", _counting(stage1.capture, "capture", calls))
    memo = ReferenceMemo()
    # New tuples of the same tensors on each call, as FitPlan.val_pairs builds them: still the same samples.
    kept = [validation_kl(qwen, qwen, [tuple(s) for s in val], t, memo=memo) for t in translators]
    kept.append(validation_kl(qwen, qwen, val, None, condition="empty_prefix", memo=memo))
    assert kept[:2] == fresh  # exact equality of every float
    assert kept[0] != kept[1]  # the translator still decides the score
    assert calls.count("teacher") == 3 and calls.count("capture") == 3
    # Other tensors with the same values are other samples; a zero budget keeps nothing.
    calls.clear()
    validation_kl(qwen, qwen, [(p.clone(), c.clone()) for p, c in val], fitted, memo=memo)
    assert calls.count("teacher") == 3
    calls.clear()
    nothing_kept = ReferenceMemo(budget_bytes=0)
    for _ in range(2):
        validation_kl(qwen, qwen, val, fitted, memo=nothing_kept)
    assert calls.count("teacher") == 6 and calls.count("capture") == 6


def test_pair_whose_attention_types_do_not_correspond_maps_across_types():
    # qwen3 has only global layers, gemma3 mixes sliding and global: the same-type rule would refuse the pair
    # (no sliding source layer), so types are ignored and relative depth spans the whole source.
    src_model, tgt_model = tiny_model("qwen3", seed=1), tiny_model("gemma3", seed=2)
    src, tgt = cache_layout(src_model), cache_layout(tgt_model)
    band = candidate_layers(src, tgt, "depth", 1)
    assert band == relative_depth(src.n_layers, tgt.n_layers, 1)
    assert band == {0: (0,), 1: (1,), 2: (1,), 3: (2,)}
    # Two mixed-type models keep the rule: sliding reads sliding, global reads global.
    typed = candidate_layers(tgt, tgt, "depth", 1)
    assert all(tgt.attention_types[s] == tgt.attention_types[t] for t, srcs in typed.items() for s in srcs)


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
        accumulate_pair(stats, bad, bad, [(p, p[-2:]) for p in prefixes(1)], "pre_norm")


def test_attention_weights_follow_app_o(qwen):
    from translators.stage1 import attention_weights

    prefix, continuation = prefixes(1, length=20)[0], prefixes(1, length=6, seed=3)[0]
    w = attention_weights(qwen, prefix, continuation)
    assert w.shape == (20,) and (w >= 0).all() and w.sum() <= 1 + 1e-5
    # Reference: the model's own attention probabilities, averaged over layers, heads and the m query rows.
    qwen.model.set_attn_implementation("eager")
    ids = torch.cat([prefix, continuation[:-1]]).view(1, -1)
    att = qwen.model(input_ids=ids, output_attentions=True).attentions
    qwen.model.set_attn_implementation("sdpa")
    ref = torch.stack([a[0, :, 19:25, :20].mean(dim=(0, 1)) for a in att]).mean(0)
    torch.testing.assert_close(w, ref)
    assert qwen.model.config._attn_implementation == "sdpa"  # restored


def test_attention_weighted_fit_of_an_exact_map_is_still_exact(qwen):
    # Weighting changes the norm, not the minimiser when the map is exact: self-translation stays the identity.
    candidates = candidate_layers(qwen.layout, qwen.layout, "depth", 1)
    train = [(p, p[-4:]) for p in prefixes(10)]
    stats = accumulate_pair(empty_stats(qwen.layout, qwen.layout, candidates), qwen, qwen, train, "pre_norm",
                            weighting="attention")
    assert stats["keys"].weight_sum < stats["keys"].n_tokens  # real weights, not ones
    translator = solve_translator(stats, assign_layers(stats, qwen.layout, qwen.layout, "depth", 1), qwen.layout,
                                  qwen.layout, "pre_norm", ridge=1e-9)
    torch.testing.assert_close(translator.weight("values", 0), torch.eye(32), atol=1e-3, rtol=0)
    with pytest.raises(ConfigError, match="unknown weighting"):
        accumulate_pair(stats, qwen, qwen, train, "pre_norm", weighting="attn")


def test_attention_weighting_never_switches_the_kernel_under_a_concurrent_capture():
    """Prefect runs Gram shards in threads on one shared model; App. O's weights switch it to eager attention.
    A capture on another thread must never run while that switch is in effect (it would read other kernels)."""
    import threading

    from translators.capture import capture
    from translators.stage1 import attention_weights

    model = tiny_model("qwen3")
    side = Side(model, cache_layout(model))
    original = model.config._attn_implementation
    switched, seen = threading.Event(), []
    set_impl = model.set_attn_implementation

    def slow_switch(name):  # widen the window in which the model is eager, and say when it opens
        set_impl(name)
        if name == "eager":
            switched.set()
            threading.Event().wait(0.3)

    model.set_attn_implementation = slow_switch
    model.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    prefix, continuation = prefixes(1, length=20)[0], prefixes(1, length=6, seed=3)[0]
    worker = threading.Thread(target=attention_weights, args=(side, prefix, continuation))
    worker.start()
    switched.wait(5)
    capture(model, side.layout, prefix)
    worker.join()
    assert seen == ["eager", original]  # the weights' forward, then the capture's after the switch back


def test_default_nu_reads_two_source_layers_or_all_of_a_type_when_fewer():
    """`kvlingo fit` without --nu: 2 source layers per target layer, capped by the fewest source layers a target
    layer may read (its attention type's, when the two models' types correspond)."""
    from translators.stage1 import DEFAULT_NU, default_nu

    qwen, gemma = (cache_layout(tiny_model(f)) for f in ("qwen3", "gemma3"))
    assert DEFAULT_NU == 2
    assert default_nu(qwen, qwen) == 2
    assert default_nu(gemma, gemma) == 1  # gemma's one global layer is all its global target layer may read
    assert default_nu(gemma, qwen) == 2  # types that do not correspond are ignored
    assert default_nu(qwen, gemma) == 2
