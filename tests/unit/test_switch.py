"""The switch runtime and the multi-turn conversation on tiny random-init models of every family.

With the identity translator between copies of one model, a switch must reproduce the model's own greedy
generation token for token (the reference is transformers' `generate`, independent of our decoding loop).
"""

import copy

import pytest
import torch
from tiny_configs import FAMILIES, save_tiny_model_dir, tiny_model
from transformers import GenerationConfig

from evals.switch_quality import summarize, switch_quality, token_id_f1
from translators.capture import capture
from translators.conversation import Conversation
from translators.errors import ConfigError, PairMismatchError, PrefixTooLongError
from translators.generation import GenerationSettings
from translators.layout import cache_layout
from translators.stage1 import Side, random_like
from translators.switch import identity_translator, reprefill_generate, switch_generate

NEW = 8


@pytest.fixture(scope="module", params=FAMILIES)
def side(request):
    model = tiny_model(request.param)
    return Side(model, cache_layout(model))


def tokens(n, seed):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, ids, new=NEW):
    """transformers' own greedy generation: the independent reference."""
    # No eos: the tiny configs name token ids as eos, and our runtime stops only on the stop ids it is given
    # (generate merges the model's own generation config, so clear it there).
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0)
    out = model.generate(ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                         generation_config=config)
    assert out.shape[1] == ids.numel() + new
    return out[0, ids.numel():].tolist()


def perturbed_identity(layout, scale=0.05, seed=0):
    """A translator that is almost the identity: each pass through it adds a small, fixed error."""
    translator = identity_translator(layout)
    g = torch.Generator().manual_seed(seed)
    for name, weight in translator.maps.items():
        weight.data.add_(scale * torch.randn(weight.shape, generator=g) / weight.shape[0] ** 0.5)
    return translator


# --- Single switch --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, seed", [(9, 1), (20, 2), (33, 3)])
def test_identity_switch_reproduces_native_greedy(side, n, seed):
    ids = tokens(n, seed)
    settings = GenerationSettings(max_new_tokens=NEW)
    reference = hf_greedy(side.model, ids)
    assert switch_generate(side, side, ids, None, settings).token_ids == reference
    # App. T: translate only a leading part, the target reads the rest itself.
    for k in (1, n // 2):
        assert switch_generate(side, side, ids, None, settings, context_len=k).token_ids == reference
    assert switch_generate(side, side, ids, identity_translator(side.layout), settings).token_ids == reference
    assert reprefill_generate(side, ids, settings).token_ids == reference


def test_switch_from_a_separate_copy_and_held_capture(side):
    copy_side = Side(copy.deepcopy(side.model), side.layout)
    ids = tokens(17, 4)
    held = capture(copy_side.model, copy_side.layout, ids[:-1], "post_norm")
    result = switch_generate(copy_side, side, ids, None, GenerationSettings(max_new_tokens=NEW), point="post_norm",
                             source_capture=held)
    assert result.token_ids == hf_greedy(side.model, ids)


def test_sampling_is_seeded_and_path_independent():
    model = tiny_model("llama")
    side = Side(model, cache_layout(model))
    ids = tokens(15, 5)
    settings = GenerationSettings(max_new_tokens=12, temperature=1.5, top_p=0.9, seed=7)
    switched = switch_generate(side, side, ids, None, settings).token_ids
    # Same cache, same seed → the same samples on both paths; another seed draws other tokens.
    assert switched == reprefill_generate(side, ids, settings).token_ids
    other = reprefill_generate(side, ids, GenerationSettings(max_new_tokens=12, temperature=1.5, top_p=0.9, seed=8))
    assert other.token_ids != switched
    assert switched != hf_greedy(model, ids, 12)


def test_stop_id_ends_generation_and_timings_add_up():
    model = tiny_model("qwen3")
    side = Side(model, cache_layout(model))
    ids = tokens(12, 6)
    greedy = hf_greedy(model, ids)
    stop = greedy[2]
    first_at = greedy.index(stop)
    result = switch_generate(side, side, ids, None, GenerationSettings(max_new_tokens=NEW, stop_ids=(stop,)))
    assert result.token_ids == greedy[: first_at + 1] and result.stopped == "stop_id"
    full = switch_generate(side, side, ids, None, GenerationSettings(max_new_tokens=NEW))
    assert full.stopped == "max_new_tokens" and len(full.token_ids) == NEW
    assert full.translate_s > 0 and full.first_step_s > 0 and full.decode_s > 0
    assert full.time_to_first_token_s >= full.translate_s + full.first_step_s
    prefill = reprefill_generate(side, ids, GenerationSettings(max_new_tokens=NEW))
    assert prefill.translate_s == 0 and prefill.context_len == 0 and full.context_len == 11


def test_text_is_decoded_with_a_tokenizer():
    from tiny_configs import tiny_tokenizer

    model = tiny_model("llama")
    side = Side(model, cache_layout(model))
    tok = tiny_tokenizer()
    result = switch_generate(side, side, tokens(10, 7), None, GenerationSettings(max_new_tokens=4), tokenizer=tok)
    assert result.text == tok.decode(result.token_ids, skip_special_tokens=True) and result.text


# --- Errors ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    model = tiny_model("qwen3")
    side = Side(model, cache_layout(model))
    settings = GenerationSettings(max_new_tokens=4)
    with pytest.raises(ConfigError, match="empty"):
        switch_generate(side, side, [], None, settings)
    with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer"):
        switch_generate(side, side, tokens(5, 0), None, GenerationSettings(max_new_tokens=0))
    with pytest.raises(PrefixTooLongError, match="200 tokens.*at most 128"):
        switch_generate(side, side, tokens(200, 0), None, settings)
    with pytest.raises(PrefixTooLongError, match="lower max_new_tokens to at most 8"):
        switch_generate(side, side, tokens(121, 0), None, GenerationSettings(max_new_tokens=20))
    with pytest.raises(ConfigError, match=r"context_len must be an integer in \[0, 4\]"):
        switch_generate(side, side, tokens(5, 0), None, settings, context_len=5)
    with pytest.raises(ConfigError, match="temperature"):
        switch_generate(side, side, tokens(5, 0), None, GenerationSettings(temperature=-1.0))
    other = tiny_model("llama")
    with pytest.raises(PairMismatchError, match="identity only works between copies of one model"):
        switch_generate(side, Side(other, cache_layout(other)), tokens(5, 0), None, settings)
    with pytest.raises(PairMismatchError, match="writes 3 target layers, the target has 2"):
        mistral = tiny_model("mistral")
        switch_generate(side, Side(mistral, cache_layout(mistral)), tokens(5, 0), identity_translator(side.layout), settings)


def test_translator_artifact_for_another_pair_is_refused(tmp_path):
    from infra.pairs import load_for_pair
    from infra.zoo import load_model, model_signature
    from translators.artifact import save_translator

    first = load_model(str(save_tiny_model_dir("qwen3", tmp_path / "a", seed=0)))
    second = load_model(str(save_tiny_model_dir("qwen3", tmp_path / "b", seed=1)))
    sig = model_signature(first)
    save_translator(identity_translator(first.layout), tmp_path / "t", source=sig, target=sig, fit={"stage": "identity"})
    translator = load_for_pair(tmp_path / "t", first, first)
    result = switch_generate(Side(first.model, first.layout), Side(first.model, first.layout), tokens(9, 1), translator,
                             GenerationSettings(max_new_tokens=NEW))
    assert result.token_ids == hf_greedy(first.model, tokens(9, 1))
    with pytest.raises(PairMismatchError, match="fitted for another target model"):
        load_for_pair(tmp_path / "t", first, second)


# --- Multi-turn -----------------------------------------------------------------------------------


def run_turns(conversation, reference_side, n_turns=5, new=6):
    """Alternate holders a/b; user turns of 4-6 tokens. Returns whether every turn matched native greedy."""
    matches = []
    for turn in range(n_turns):
        conversation.append(tokens(4 + turn % 3, 100 + turn))
        conversation.switch_to("ab"[turn % 2])
        settings = GenerationSettings(max_new_tokens=new)
        expected = reprefill_generate(reference_side, conversation.tokens, settings).token_ids
        matches.append(conversation.generate(settings).token_ids == expected)
    return matches


def test_segment_conversation_reproduces_native_greedy(side):
    twin = Side(copy.deepcopy(side.model), side.layout)
    conversation = Conversation({"a": side, "b": twin}, holder="a")
    assert all(run_turns(conversation, side))
    counts = conversation.translation_counts
    # Every span written before the last switch was translated exactly once; the last holder's is untranslated.
    assert sorted(counts.values()) == [0] + [1] * (len(counts) - 1)
    assert conversation.max_translation_count() == 1
    for name in ("a", "b"):
        line = conversation.lines[name]
        assert torch.equal(line.positions, torch.arange(line.n_tokens))
        assert all(seg.hops <= 1 for seg in line.segments)
        assert all(seg.hops == (seg.origin != name) for seg in line.segments)
    # The spans tile the history the models have read, without gaps.
    spans = conversation.spans
    assert spans[0].start == 0 and all(x.end == y.start for x, y in zip(spans, spans[1:]))


@pytest.mark.parametrize("mode", ["naive", "reprefill"])
def test_other_modes_with_identity_are_exact_and_counted(mode):
    model = tiny_model("qwen3")
    a = Side(model, cache_layout(model))
    conversation = Conversation({"a": a, "b": Side(copy.deepcopy(model), a.layout)}, holder="a", mode=mode)
    assert all(run_turns(conversation, a))
    counts = conversation.translation_counts
    if mode == "naive":
        # The first span went back and forth at every one of the four switches.
        assert counts[(conversation.spans[0].start, conversation.spans[0].end)] == 4
        assert max(seg.hops for seg in conversation.lines[conversation.holder].segments) == 4
    else:
        assert set(counts.values()) == {0}
        assert all(seg.hops == 0 for line in conversation.lines.values() for seg in line.segments)


def test_naive_compounds_translation_error_segment_does_not():
    model = tiny_model("llama")
    a = Side(model, cache_layout(model))
    b = Side(copy.deepcopy(model), a.layout)
    translators = {("a", "b"): perturbed_identity(a.layout, seed=1), ("b", "a"): perturbed_identity(a.layout, seed=2)}
    errors = {}
    for mode in ("segment", "naive"):
        conversation = Conversation({"a": a, "b": b}, holder="a", translators=translators, mode=mode)
        run_turns(conversation, a)
        line = conversation.lines[conversation.holder]
        native = capture(model, a.layout, torch.tensor(conversation.tokens[: line.n_tokens]), "pre_norm")
        first = conversation.spans[0]
        errors[mode] = max((line.values[layer][first.start:first.end] - native.values[layer][first.start:first.end]).norm()
                           / native.values[layer][first.start:first.end].norm() for layer in range(a.layout.n_layers))
    # Segment: the holder (a) wrote the first span itself, so its line holds it natively.
    assert errors["segment"] < 1e-5 < errors["naive"]


def test_refresh_rebuilds_a_native_line():
    model = tiny_model("llama")
    a = Side(model, cache_layout(model))
    translators = {("a", "b"): perturbed_identity(a.layout), ("b", "a"): perturbed_identity(a.layout, seed=3)}
    conversation = Conversation({"a": a, "b": Side(copy.deepcopy(model), a.layout)}, holder="a",
                                translators=translators, refresh_every=2)
    run_turns(conversation, a, n_turns=5)
    hows = [e.how for e in conversation.events if hasattr(e, "how")]
    assert "refresh" in hows and "segment" in hows
    refreshed = [e for e in conversation.events if getattr(e, "how", None) == "refresh"][0]
    assert refreshed.n_tokens > 0


def test_conversation_errors():
    model = tiny_model("qwen3")
    a = Side(model, cache_layout(model))
    b = Side(copy.deepcopy(model), a.layout)
    with pytest.raises(ConfigError, match="did you mean 'segment'"):
        Conversation({"a": a, "b": b}, holder="a", mode="segmnt")
    with pytest.raises(ConfigError, match="at least two models"):
        Conversation({"a": a}, holder="a")
    with pytest.raises(ConfigError, match=r"missing \[\('b', 'a'\)\]"):
        Conversation({"a": a, "b": b}, holder="a", translators={("a", "b"): None})
    conversation = Conversation({"a": a, "b": b}, holder="a")
    with pytest.raises(ConfigError, match="unknown model 'c'"):
        conversation.switch_to("c")
    with pytest.raises(ConfigError, match="append the prompt"):
        conversation.generate()
    with pytest.raises(ConfigError, match="nothing to append"):
        conversation.append([])
    with pytest.raises(PrefixTooLongError, match="at most 128"):
        conversation.append(list(range(90)) * 2)


# --- Switch quality -------------------------------------------------------------------------------


def test_token_id_f1():
    assert token_id_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_id_f1([], []) == 1.0 and token_id_f1([1], []) == 0.0
    assert token_id_f1([1, 1, 2], [1, 2, 2]) == pytest.approx(2 / 3)


def test_switch_quality_identity_is_perfect_random_map_is_not():
    model = tiny_model("qwen3")
    side = Side(model, cache_layout(model))
    prefixes = [tokens(10 + i, 200 + i) for i in range(4)]
    settings = GenerationSettings(max_new_tokens=6)
    exact = summarize(switch_quality(side, side, prefixes, None, settings))
    assert exact["first_token_agreement"] == 1.0 and exact["token_f1"] == 1.0
    noise = summarize(switch_quality(side, side, prefixes, random_like(identity_translator(side.layout)), settings))
    assert noise["token_f1"] < 1.0
    with pytest.raises(ConfigError, match="greedy"):
        switch_quality(side, side, prefixes, None, GenerationSettings(temperature=1.0))


def test_switch_quality_benchmark_scores_each_condition_against_target_native():
    """The `switch_quality` benchmark (evals/benchmarks/): held-out switch prefixes, token F1 against the
    target-native continuation; the identity switch keeps it, a random map does not."""
    from types import SimpleNamespace

    from tiny_configs import tiny_tokenizer

    from evals.benchmarks import BenchContext, get
    from evals.conditions import target_native, translated

    model = tiny_model("qwen3", max_position_embeddings=512)
    loaded = SimpleNamespace(name="qwen3", model=model, layout=cache_layout(model), tokenizer=tiny_tokenizer())
    context = BenchContext(source=loaded, target=loaded, max_new_tokens=6)
    side, run = Side(model, loaded.layout), get("switch_quality").run
    native = run(context, target_native(side), 3)
    assert native == {"0": 1.0, "1": 1.0, "2": 1.0}
    assert run(context, translated(side, side), 3) == native
    noise = run(context, translated(side, side, random_like(identity_translator(side.layout))), 3)
    assert set(noise) == set(native) and sum(noise.values()) < 3.0
