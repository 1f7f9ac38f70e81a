"""The DroidSpeak-style partial-recompute baseline (translators.partial_recompute) on tiny GDN hybrids: recomputing
every layer is a native prefill, none is the translator alone, and the compute share is the layers' weight share."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import tiny_gdn_model, tiny_model
from translators.capture import capture_hybrid
from translators.errors import ConfigError
from translators.hybrid import HybridTranslator, fit_kv_maps, sample_kls, strategies_for
from translators.layout import cache_layout
from translators.partial_recompute import compute_fraction, recomputed_objects
from translators.states import COPY, StateMaps


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    """Two independently initialised tiny GDN hybrids of one geometry (layers 0-1 GDN, 2 attention) and a copy
    translator between them (K/V maps fitted on a few prompts)."""
    source, target = tiny_gdn_model(seed=1), tiny_gdn_model(seed=0)
    src_layout, tgt_layout = cache_layout(source), cache_layout(target)
    translator = HybridTranslator(src_layout, tgt_layout,
                                  StateMaps(src_layout, tgt_layout, strategies_for(tgt_layout, COPY)))
    prompts = [_ids(14 + i % 5, 50 + i) for i in range(12)]
    with torch.no_grad():
        fit_kv_maps(translator, [capture_hybrid(source, src_layout, p) for p in prompts],
                    [capture_hybrid(target, tgt_layout, p) for p in prompts], ridge=1e-4)
    samples = [(_ids(12 + i, 70 + i), _ids(5, 90 + i)) for i in range(4)]
    return source, src_layout, target, tgt_layout, translator, samples


def test_recomputing_every_layer_is_a_native_prefill_and_none_is_the_translator(pair):
    source, src_layout, target, tgt_layout, translator, samples = pair
    alone, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator)
    none, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator, recompute=0)
    every, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator, recompute=3)
    one, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator, recompute=1)
    assert none == alone and min(alone) > 0.05  # independent models: the translated cache is far from native
    assert max(every) < 1e-6  # against the target's own forward over prefix + continuation (the teacher)
    assert one != alone  # layer 0's objects were replaced
    with pytest.raises(ConfigError, match=r"recompute layers must lie in \[0, 3\], got 4"):
        sample_kls(source, src_layout, target, tgt_layout, samples, translator, recompute=4)


def test_recomputed_objects_take_the_lower_layers_from_the_native_capture(pair):
    source, src_layout, target, tgt_layout, translator, _ = pair
    prefix = _ids(11, 5)
    with torch.no_grad():
        tokens, states = translator(capture_hybrid(source, src_layout, prefix))
        native = capture_hybrid(target, tgt_layout, prefix)
    mixed_tokens, mixed_states = recomputed_objects(tokens, states, native, 2, tgt_layout.n_layers)
    for name, objects in states.items():  # layers 0, 1: native; there are no linear layers above
        assert set(mixed_states[name]) == {0, 1}
        assert all(torch.equal(mixed_states[name][t], native.states[name][t]) for t in (0, 1))
    for name, objects in tokens.items():  # attention layer 2: the translated objects, untouched
        assert mixed_tokens[name][2] is objects[2]
    with pytest.raises(ConfigError, match="holds 11 tokens, the translated objects \\[10\\]"):
        recomputed_objects({n: {t: x[:-1] for t, x in o.items()} for n, o in tokens.items()}, states, native, 1, 3)


def test_compute_fraction_is_the_layers_share_of_the_decoder_weights():
    model = tiny_model("llama", seed=0)  # identical layers: k of L
    n = len(model.model.layers)
    assert [compute_fraction(model, k) for k in range(n + 1)] == pytest.approx([k / n for k in range(n + 1)])
    hybrid = tiny_gdn_model(seed=0)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in hybrid.model.layers]
    assert sizes[0] != sizes[2]  # a GDN layer and an attention layer differ
    assert compute_fraction(hybrid, 2) == pytest.approx((sizes[0] + sizes[1]) / sum(sizes))
    with pytest.raises(ConfigError, match=r"\[0, 3\], got -1"):
        compute_fraction(hybrid, -1)


def test_native_states_keep_the_translated_tokens_and_take_every_state_from_the_target(pair):
    """On this layout (layers 0-1 GDN, 2 attention) the target's own states under the translated K/V are exactly a
    recompute of its two linear layers; the unknown-condition error names the choices."""
    source, src_layout, target, tgt_layout, translator, samples = pair
    native, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator, condition="native_states")
    recomputed, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator, recompute=2)
    copied, _ = sample_kls(source, src_layout, target, tgt_layout, samples, translator)
    assert native == pytest.approx(recomputed, abs=1e-9)
    assert all(abs(a - b) > 1e-4 for a, b in zip(native, copied))
    with pytest.raises(ConfigError, match="unknown condition 'oracle' .choose from translated, native_states"):
        sample_kls(source, src_layout, target, tgt_layout, samples, translator, condition="oracle")
