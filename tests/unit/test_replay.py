"""The replay state strategy (translators.replay, paper 004 §3.5) on tiny random-init models: the target's own
mixer over its native inputs is its native state, the closed form is a plain least-squares solve, and a fitted
replay carries a GQA source's prompt into a GDN target's states."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import exact_hybrid_copy, tiny_gdn_model, tiny_model
from translators.capture import capture_hybrid
from translators.errors import ConfigError
from translators.hybrid import (
    HybridTranslator,
    distill_hybrid,
    fit_kv_maps,
    fit_replay_maps,
    hybrid_validation_kl,
    make_translator,
    paired_captures,
    random_like,
    strategies_for,
)
from translators.layout import cache_layout
from translators.replay import ReplayMaps, fit_replay, mixer_inputs, replay_mixer, replay_sources
from translators.states import CONV, REPLAY, STATE, ZERO, StateMaps


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gqa_to_gdn():
    """A tiny GQA source (qwen3, 3 layers) and a tiny GDN target (layers 0-1 GDN, 2 attention), with paired
    captures of 30 prompts and 8 validation samples. The source reads the target's token embedding (both first
    norms are the identity at init), so its layer-0 keys | values ([64], from a generic 64 x 64 projection) are
    an invertible linear function of the target's layer-0 mixer input: replaying layer 0 from them is exact."""
    source, target = tiny_model("qwen3", seed=1), tiny_gdn_model(seed=0)
    with torch.no_grad():
        source.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    src_layout, tgt_layout = cache_layout(source), cache_layout(target)
    prompts = [_ids(14 + i % 7, 100 + i) for i in range(30)]
    src_caps, tgt_caps = paired_captures(source, src_layout, target, tgt_layout, prompts)
    samples = [(_ids(12 + i % 5, 300 + i), _ids(5, 400 + i)) for i in range(8)]
    return source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples


def test_the_targets_mixer_over_its_own_inputs_leaves_its_native_state():
    model = tiny_gdn_model(seed=0)
    layout = cache_layout(model)
    ids = _ids(17, 1)
    native = capture_hybrid(model, layout, ids)
    inputs = mixer_inputs(model, [0, 1], ids)
    assert inputs[0].shape == (17, 64)
    for layer in (0, 1):
        conv, state = replay_mixer(model, layer, inputs[layer])
        assert torch.equal(conv, native.states[CONV][layer]) and torch.equal(state, native.states[STATE][layer])


def test_replay_is_differentiable_in_the_predicted_inputs():
    model = tiny_gdn_model(seed=0)
    inputs = mixer_inputs(model, [1], _ids(9, 2))[1].clone().requires_grad_(True)
    conv, state = replay_mixer(model, 1, inputs)
    (conv.square().sum() + state.square().sum()).backward()
    assert inputs.grad is not None and inputs.grad.abs().sum() > 0


def test_replay_reads_the_source_token_layers_nearest_in_relative_depth():
    gqa = cache_layout(tiny_model("qwen3"))  # 3 attention layers
    gdn = cache_layout(tiny_gdn_model())  # linear 0, 1; attention 2
    assert replay_sources(gqa, gdn, [0, 1], nu=2) == {0: [0, 1], 1: [1, 2]}
    assert replay_sources(gqa, gdn, [0, 1], nu=1) == {0: [0], 1: [1]}
    assert replay_sources(gdn, gdn, [0, 1], nu=1) == {0: [2], 1: [2]}  # a hybrid's tokens live in its attention
    with pytest.raises(ConfigError, match=r"the source has 1 \(\[2\]\), got nu=2"):
        replay_sources(gdn, gdn, [0], nu=2)
    with pytest.raises(ConfigError, match="replay synthesises linear-attention layers"):
        ReplayMaps(gqa, gdn, [2], hidden=64)


def test_the_closed_form_is_the_least_squares_solution():
    gqa = cache_layout(tiny_model("qwen3"))
    gdn = cache_layout(tiny_gdn_model())
    maps = ReplayMaps(gqa, gdn, [0], hidden=5, nu=2)
    g = torch.Generator().manual_seed(0)
    tokens = [{name: {s: torch.randn(n, 32, generator=g) for s in range(3)} for name in ("keys", "values")}
              for n in (120, 151, 125)]  # 396 rows, 129 features: overdetermined
    inputs = [{0: torch.randn(len(t["keys"][0]), 5, generator=g)} for t in tokens]
    fits = fit_replay(maps, tokens, inputs, ridge=1e-12)
    design = torch.cat([torch.cat([t["keys"][0], t["values"][0], t["keys"][1], t["values"][1],
                                   torch.ones(len(t["keys"][0]), 1)], -1) for t in tokens]).double()
    reference = torch.linalg.lstsq(design, torch.cat([i[0] for i in inputs]).double()).solution  # [129, 5]
    assert torch.allclose(maps.weights["0"].double(), reference.T, atol=1e-5)
    assert fits[0].source_layers == (0, 1) and 0 < fits[0].r2 < 1
    with pytest.raises(ConfigError, match="pair 0: 120 source tokens but 3 target tokens"):
        fit_replay(maps, tokens[:1], [{0: torch.randn(3, 5)}])


def test_replaying_from_objects_that_determine_the_inputs_reproduces_the_native_state(gqa_to_gdn):
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples = gqa_to_gdn
    translator = make_translator(src_layout, tgt_layout, target, {0: REPLAY, 1: ZERO}, replay_nu=1)
    assert translator.replay.sources == {0: [0]}
    fits = fit_replay_maps(translator, target, src_caps, prompts, ridge=1e-10, n_heldout=6)
    assert fits[0].r2 > 0.9999, fits
    held = capture_hybrid(source, src_layout, samples[0][0])
    native = capture_hybrid(target, tgt_layout, samples[0][0])
    _, states = translator(held, target)
    for kind in (CONV, STATE):
        error = (states[kind][0] - native.states[kind][0]).norm() / native.states[kind][0].norm()
        assert error < 1e-3, (kind, error)


def test_a_fitted_replay_carries_the_prompt_into_the_targets_states(gqa_to_gdn):
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples = gqa_to_gdn
    kls = {}
    for strategy in (ZERO, REPLAY):
        translator = make_translator(src_layout, tgt_layout, target, strategies_for(tgt_layout, strategy))
        fit_kv_maps(translator, src_caps, tgt_caps, ridge=1e-4)
        if strategy == REPLAY:
            fit_replay_maps(translator, target, src_caps, prompts, ridge=1e-2)
        kls[strategy] = hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, translator).mean
    empty = hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, None, condition="empty_prefix").mean
    assert kls[REPLAY] < 0.8 * kls[ZERO] and kls[REPLAY] < empty, (kls, empty)


def test_stage_two_trains_the_replay_maps(gqa_to_gdn):
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples = gqa_to_gdn
    translator = make_translator(src_layout, tgt_layout, target, strategies_for(tgt_layout, REPLAY))
    fit_kv_maps(translator, src_caps, tgt_caps, ridge=1e-4)
    fit_replay_maps(translator, target, src_caps, prompts, ridge=1e-4)
    before = {k: v.detach().clone() for k, v in translator.replay.weights.items()}
    start = hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, translator).mean
    distill_hybrid(translator, source, src_layout, target, tgt_layout, samples, steps=30, lr=3e-4, batch=4)
    after = hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, translator).mean
    assert all(not torch.equal(before[k], v) for k, v in translator.replay.weights.items())
    assert after < start, (start, after)


def test_replay_layers_need_their_maps_and_the_target_model(gqa_to_gdn):
    source, src_layout, target, tgt_layout, prompts, src_caps, *_ = gqa_to_gdn
    states = StateMaps(src_layout, tgt_layout, {0: REPLAY, 1: ZERO})
    with pytest.raises(ConfigError, match=r"layers \[0\] use the 'replay' strategy but the replay maps cover \[\]"):
        HybridTranslator(src_layout, tgt_layout, states)
    translator = make_translator(src_layout, tgt_layout, target, {0: REPLAY, 1: ZERO})
    with pytest.raises(ConfigError, match="pass target_model"):
        translator(src_caps[0])
    tokens, out = translator(src_caps[0], target)
    assert set(out[STATE]) == {0, 1} and torch.count_nonzero(out[STATE][1]) == 0


def test_the_random_map_control_keeps_every_maps_norm(gqa_to_gdn):
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, _ = gqa_to_gdn
    translator = make_translator(src_layout, tgt_layout, target, strategies_for(tgt_layout, REPLAY))
    fit_kv_maps(translator, src_caps, tgt_caps, ridge=1e-4)
    fit_replay_maps(translator, target, src_caps, prompts, ridge=1e-4)
    control = random_like(translator)
    for (name, weight), (_, noise) in zip(translator.named_parameters(), control.named_parameters()):
        assert torch.allclose(weight.norm(), noise.norm(), rtol=1e-5) and not torch.allclose(weight, noise), name


def test_answers_from_an_exact_translation_equal_the_targets_own_greedy_generation():
    """A GDN self-pair with copied states and identity K/V maps is an exact translation: its greedy answer, the
    target-native answer (kvlingo's decoding loop) and transformers' own `generate` all agree."""
    from translators.generation import GenerationSettings
    from translators.hybrid import hybrid_answer
    model = tiny_gdn_model(seed=0)
    layout = cache_layout(model)
    translator = exact_hybrid_copy(layout)
    settings = GenerationSettings(max_new_tokens=6)
    for seed in range(3):
        prompt = _ids(15 + seed, 700 + seed)
        with torch.no_grad():
            reference = model.generate(input_ids=prompt.view(1, -1), do_sample=False, max_new_tokens=6,
                                       min_new_tokens=6)[0, len(prompt):].tolist()
        native = hybrid_answer(model, layout, model, layout, prompt, None, settings, condition="target_native")
        translated = hybrid_answer(model, layout, model, layout, prompt, translator, settings)
        assert native == reference and translated == reference, (native, translated, reference)
    empty = hybrid_answer(model, layout, model, layout, prompt, None, settings, condition="empty_prefix")
    assert len(empty) == 6
    with pytest.raises(ConfigError, match="unknown condition 'native'"):
        hybrid_answer(model, layout, model, layout, prompt, None, settings, condition="native")
    with pytest.raises(ConfigError, match="needs a translator"):
        hybrid_answer(model, layout, model, layout, prompt, None, settings)
