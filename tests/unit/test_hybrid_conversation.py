"""Multi-turn switching between hybrid models (translators.hybrid_conversation) on tiny random-init models:
re-prefill is the native cache, an exact translator makes segment-wise hand-offs native too, replay continues the
receiver's own recurrence, and the counters tell segment (each span once) from naive (again and again)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_configs import exact_hybrid_copy, tiny_gdn_model, tiny_model
from translators.capture import capture_hybrid
from translators.errors import ConfigError
from translators.generation import GenerationSettings
from translators.hybrid import fit_kv_maps, fit_replay_maps, make_translator, paired_captures
from translators.hybrid_conversation import HybridConversation
from translators.inject import decode_step
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.states import CONV, REPLAY, STATE

SETTINGS = GenerationSettings(max_new_tokens=4)


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def twins():
    """Two copies of one tiny GDN model: identity K/V maps and copied states translate between them exactly."""
    model = tiny_gdn_model(seed=0)
    layout = cache_layout(model)
    side = Side(model, layout)
    return {"A": side, "B": side}, {("A", "B"): exact_hybrid_copy(layout), ("B", "A"): exact_hybrid_copy(layout)}


def _play(conv, turns=4):
    answers = []
    for t in range(turns):
        if t:
            conv.switch_to("A" if t % 2 == 0 else "B")
        conv.append(_ids(5 + t, 50 + t))
        answers.append(conv.generate(SETTINGS).token_ids)
    return answers


def _native_next_logits(side, tokens):
    with torch.no_grad():
        return side.model(input_ids=torch.tensor(tokens).view(1, -1)).logits[0, -1]


@pytest.mark.parametrize("mode", ["reprefill", "segment", "naive"])
def test_exact_translation_makes_every_mode_native(twins, mode):
    models, translators = twins
    reference = _play(HybridConversation(models, holder="A", translators=translators, mode="reprefill"))
    conv = HybridConversation(models, holder="A", translators=translators, mode=mode)
    assert _play(conv) == reference
    side = models[conv.holder]
    held = conv.held[conv.holder]
    next_token = torch.tensor(conv.tokens[held.seen:])  # the last generated token, not yet read
    with torch.no_grad():
        logits = decode_step(side.model, held.cache, next_token, logits_to_keep=1)[-1]
    assert torch.allclose(logits, _native_next_logits(side, conv.tokens), atol=1e-4)


def test_segment_translates_each_span_once_and_naive_again(twins):
    models, translators = twins
    segment = HybridConversation(models, holder="A", translators=translators, mode="segment")
    naive = HybridConversation(models, holder="A", translators=translators, mode="naive")
    _play(segment, 6), _play(naive, 6)
    assert segment.max_translation_count() == 1
    assert naive.max_translation_count() == 5  # the first span goes to the other model at each of 5 switches
    records = [e for e in segment.events if hasattr(e, "how")]
    assert all(r.how == "segment" and r.n_tokens > 0 for r in records)


def test_replay_continues_the_receivers_own_recurrence():
    """A GQA source sharing the target's embedding determines the target's layer-0 mixer inputs exactly, so
    replaying layer 0 segment by segment must leave the state a native prefill of the whole history leaves."""
    target = tiny_gdn_model(seed=0)
    source = tiny_model("qwen3", seed=1)
    with torch.no_grad():
        source.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    src, tgt = cache_layout(source), cache_layout(target)
    prompts = [_ids(30, 100 + i) for i in range(20)]
    to_target = make_translator(src, tgt, target, {0: REPLAY, 1: REPLAY}, replay_nu=1)
    caps = paired_captures(source, src, target, tgt, prompts)
    fit_kv_maps(to_target, *caps, ridge=1e-6)
    fit_replay_maps(to_target, target, caps[0], prompts, ridge=1e-10)
    to_source = make_translator(tgt, src, source, {})
    fit_kv_maps(to_source, caps[1], caps[0], ridge=1e-6)
    models = {"G": Side(source, src), "H": Side(target, tgt)}
    conv = HybridConversation(models, holder="H", translators={("G", "H"): to_target, ("H", "G"): to_source})
    for t, holder in enumerate(["H", "G", "H", "G"]):
        conv.switch_to(holder)
        conv.append(_ids(6, 200 + t))
        conv.generate(SETTINGS)
    conv.switch_to("H")
    native = capture_hybrid(target, tgt, torch.tensor(conv.tokens[:conv.seen("H")]))
    held = conv.held["H"].cache
    for kind, got in ((STATE, held.get_recurrent_state(0)), (CONV, held.get_conv_state(0))):
        error = (got - native.states[kind][0]).norm() / native.states[kind][0].norm()
        assert error < 1e-3, (kind, error)
    assert conv.max_translation_count() == 1


def test_a_conversation_needs_every_translator(twins):
    models, translators = twins
    with pytest.raises(ConfigError, match=r"missing \[\('B', 'A'\)\]"):
        HybridConversation(models, holder="A", translators={("A", "B"): translators[("A", "B")]})
    with pytest.raises(ConfigError, match="unknown conversation mode .lazy."):
        HybridConversation(models, holder="A", translators=translators, mode="lazy")
