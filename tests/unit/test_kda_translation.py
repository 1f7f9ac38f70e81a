"""Translation between MLA and a Kimi-Linear hybrid (KDA + NoPE MLA) on tiny random-init models: latent maps
for the attention layer, replay for the KDA layers, token identity appended to every map, and the reverse
direction (a hybrid source's latents into an MLA target)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import tiny_kda_model, tiny_mla_model
from translators.errors import ConfigError
from translators.hybrid import (
    attach_token_identity,
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
from translators.states import REPLAY, ZERO


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def mla_to_kda():
    """A tiny MLA source (DeepSeek-V3, 3 layers) and a tiny KDA target (KDA 0-1, NoPE MLA 2), paired captures of
    30 prompts and 8 validation samples. The source reads the target's token embedding, so both caches carry
    the same tokens, as members of one model family do."""
    source, target = tiny_mla_model("deepseek_v3", seed=1), tiny_kda_model(seed=0)
    with torch.no_grad():
        source.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    src_layout, tgt_layout = cache_layout(source), cache_layout(target)
    prompts = [_ids(14 + i % 7, 100 + i) for i in range(30)]
    src_caps, tgt_caps = paired_captures(source, src_layout, target, tgt_layout, prompts)
    samples = [(_ids(12 + i % 5, 300 + i), _ids(5, 400 + i)) for i in range(8)]
    return source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples


def _fit(pair, strategy, token_identity=None):
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, _ = pair
    translator = make_translator(src_layout, tgt_layout, target, strategies_for(tgt_layout, strategy),
                                 token_identity=token_identity)
    attach_token_identity(translator, source, src_layout, target)
    fits = fit_kv_maps(translator, src_caps, tgt_caps, ridge=1e-4)
    if strategy == REPLAY:
        fit_replay_maps(translator, target, src_caps, prompts, ridge=1e-2)
    return translator, fits


def _kl(pair, translator):
    source, src_layout, target, tgt_layout, *_, samples = pair
    return hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, translator).mean


def test_latent_maps_read_the_sources_latent_and_rotary_key(mla_to_kda):
    translator, fits = _fit(mla_to_kda, ZERO)
    assert translator.inputs == {2: {"latent": ("latent",), "rope_key": ("rope_key",)}}
    assert translator.attention_assignment == {2: 2}
    assert translator.kv["latent_2"].shape == (32, 32) and translator.kv["rope_key_2"].shape == (8, 8)
    assert set(fits[0].r2) == {"latent", "rope_key"}


def test_the_closed_form_equals_a_least_squares_solve(mla_to_kda):
    *_, src_caps, tgt_caps, _ = mla_to_kda
    translator, _ = _fit(mla_to_kda, ZERO)
    x = torch.cat([c.tokens["latent"][2] for c in src_caps]).double()
    y = torch.cat([c.tokens["latent"][2] for c in tgt_caps]).double()
    reference = torch.linalg.lstsq(x, y).solution.T  # [32, 32]; ridge 1e-4 barely moves a well-posed solve
    assert torch.allclose(translator.kv["latent_2"].double(), reference, atol=2e-3)


def test_replay_beats_zero_states_and_both_controls(mla_to_kda):
    source, src_layout, target, tgt_layout, *_, samples = mla_to_kda
    zero, _ = _fit(mla_to_kda, ZERO)
    replay, _ = _fit(mla_to_kda, REPLAY)
    kl = {"zero": _kl(mla_to_kda, zero), "replay": _kl(mla_to_kda, replay),
          "random": _kl(mla_to_kda, random_like(replay)),
          "empty": hybrid_validation_kl(source, src_layout, target, tgt_layout, samples, None,
                                        condition="empty_prefix").mean}
    assert kl["replay"] < 0.8 * kl["zero"] and kl["replay"] < min(kl["random"], kl["empty"]), kl


@pytest.mark.parametrize("variant", ["ids", "codebook"])
def test_token_identity_widens_every_map_and_lowers_the_closed_forms_kl(mla_to_kda, variant):
    plain, _ = _fit(mla_to_kda, REPLAY)
    with_tokens, _ = _fit(mla_to_kda, REPLAY, token_identity=variant)
    hidden = 64
    assert with_tokens.kv["latent_2"].shape == (32, 32 + hidden)
    assert all(w.shape[1] == plain.replay.weights[t].shape[1] + hidden for t, w in with_tokens.replay.weights.items())
    assert _kl(mla_to_kda, with_tokens) < _kl(mla_to_kda, plain)


def test_token_identity_must_be_attached_and_the_codebook_needs_a_token_layer_zero(mla_to_kda):
    source, src_layout, target, tgt_layout, prompts, src_caps, *_ = mla_to_kda
    translator = make_translator(src_layout, tgt_layout, target, strategies_for(tgt_layout, ZERO), token_identity="ids")
    with pytest.raises(ConfigError, match="attach it for the loaded pair"):
        translator(src_caps[0], target)
    reverse = make_translator(tgt_layout, src_layout, source, {}, token_identity="codebook")
    with pytest.raises(ConfigError, match="layer 0 of kimi_linear is a linear-attention layer"):
        attach_token_identity(reverse, target, tgt_layout, source)


def test_stage_two_trains_latent_and_replay_maps(mla_to_kda):
    source, src_layout, target, tgt_layout, *_, samples = mla_to_kda
    translator, _ = _fit(mla_to_kda, REPLAY)
    before = {k: v.detach().clone() for k, v in translator.named_parameters()}
    start = _kl(mla_to_kda, translator)
    distill_hybrid(translator, source, src_layout, target, tgt_layout, samples, steps=30, lr=3e-4, batch=4)
    assert all(not torch.equal(before[k], v) for k, v in translator.named_parameters())
    assert _kl(mla_to_kda, translator) < start


def test_a_hybrid_source_translates_its_latents_into_an_mla_target(mla_to_kda):
    """KDA → MLA: the target's three MLA layers all read the source's one attention layer (layer 2)."""
    source, src_layout, target, tgt_layout, prompts, src_caps, tgt_caps, samples = mla_to_kda
    translator = make_translator(tgt_layout, src_layout, source, {})
    assert translator.attention_assignment == {0: 2, 1: 2, 2: 2}
    fit_kv_maps(translator, tgt_caps, src_caps, ridge=1e-4)
    kl = hybrid_validation_kl(target, tgt_layout, source, src_layout, samples, translator).mean
    empty = hybrid_validation_kl(target, tgt_layout, source, src_layout, samples, None, condition="empty_prefix").mean
    assert kl < empty, (kl, empty)
