"""Multi-turn hand-off across tokenizers (`translators.cross_conversation`, `kvlingo bench multiturn` on such a pair).

Tokenizers and tiny models come from tests/unit/test_cross_tokenizer.py: A is a byte-level BPE with a ChatML template
(llama), B a "▁word" BPE without a template whose post-processor adds <s> (gemma3, sliding window 6).

References are independent of the code under test: each model's rendering tokenized whole by its own tokenizer
(`render_chat` + the tokenizer, not the transcript's block-wise tokenization), a plain native capture of those ids,
plain forwards for logits, and the single-prefix path of `translators.cross` (`cross_prompt` + `mixed_cache`).
"""

import json

import pytest
import torch
from test_cross_eval import random_translator
from test_cross_tokenizer import (  # tok_a, tok_b: the two tokenizer fixtures, shared
    CONVERSATIONS, tiny_model, tok_a, tok_b)
from tiny_configs import tiny_tokenizer
from typer.testing import CliRunner

from infra.chat import render_chat
from infra.cross_samples import cross_prompt, model_format
from translators.alignment import AlignmentError
from translators.capture import capture
from translators.cross import mixed_cache, source_capture, translated_tensors
from translators.cross_conversation import CrossConversation, ModelFormat
from translators.errors import ConfigError, PairMismatchError
from translators.generation import GenerationSettings
from translators.inject import decode_step
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.token_identity import TokenIdentity, target_embedding, with_tokens
from translators.translator import Translator

SETTINGS = GenerationSettings(max_new_tokens=3)


def _side(family, tokenizer, seed):
    model = tiny_model(family, seed, vocab_size=len(tokenizer))
    return Side(model, cache_layout(model))


@pytest.fixture(scope="module")
def pair(tok_a, tok_b):
    """Sides, formats and random translators of the A (llama, ChatML) ⇄ B (gemma3, plain) pair."""
    sides = {"A": _side("llama", tok_a, 1), "B": _side("gemma3", tok_b, 2)}
    formats = {"A": model_format(tok_a), "B": model_format(tok_b)}
    translators = {("A", "B"): random_translator(sides["A"].layout, sides["B"].layout, seed=0),
                   ("B", "A"): random_translator(sides["B"].layout, sides["A"].layout, seed=1)}
    return sides, formats, translators


def conversation(pair, mode, **kwargs):
    sides, formats, translators = pair
    return CrossConversation(sides, formats, holder="A", translators=translators, mode=mode, **kwargs)


def play(conv, turns):
    """Turns alternate A, B, A, …: a user question, a switch when the holder changes, an answer."""
    questions = [m["content"] for c in CONVERSATIONS for m in c if m["role"] == "user"]
    conv.append(CONVERSATIONS[0][:3])  # system, user, assistant: the opening, as text
    for t in range(turns):
        holder = "A" if t % 2 == 0 else "B"
        if conv.holder != holder:
            conv.switch_to(holder)
        conv.append([{"role": "user", "content": questions[t % len(questions)]}])
        conv.generate(SETTINGS)
    return conv


def rendering_ids(tokenizer, messages, plain):
    """The model's rendering of `messages`, tokenized whole (B's tokenizer adds its <s> itself)."""
    text = render_chat(tokenizer, messages, generation_prompt=False)
    return tokenizer(text, add_special_tokens=plain)["input_ids"]


def native_objects(side, ids, point="pre_norm"):
    return capture(side.model, side.layout, torch.tensor(ids), point).objects


# ------------------------------------------------------------------- 1. reprefill: every line is a native prefill


def test_reprefill_lines_equal_each_models_native_prefill_of_its_own_rendering(pair, tok_a, tok_b):
    sides, _, _ = pair
    conv = play(conversation(pair, "reprefill"), turns=3)
    conv.switch_to("B")  # B brings its line up to A's last answer
    for name, tok, plain in (("A", tok_a, False), ("B", tok_b, True)):
        ids = rendering_ids(tok, conv.messages, plain)
        assert conv.transcripts[name].ids == ids
        line = conv.lines[name]
        assert line.n_tokens == line.n_entries == len(ids)
        assert line.positions.tolist() == list(range(len(ids)))
        assert all(seg.hops == 0 and seg.origin == name for seg in line.segments)
        reference = native_objects(sides[name], ids)
        for obj, layers in reference.items():
            for got, want in zip(line.objects[obj], layers):
                torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        # The line's cache predicts what a plain forward over the same ids predicts for one more token.
        with torch.no_grad():
            nxt = torch.tensor([ids[-1]])
            got = decode_step(sides[name].model, line.to_cache(sides[name]), nxt, position=len(ids), logits_to_keep=1)[-1]
            want = sides[name].model(input_ids=torch.tensor([ids + ids[-1:]])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert conv.max_translation_count() == 0


# ------------------------------------------------------- 2. segment: each span once, lines cover their renderings


def test_segment_translates_each_span_once_and_lines_cover_their_renderings(pair, tok_a, tok_b):
    conv = play(conversation(pair, "segment"), turns=4)
    conv.switch_to("A")
    assert conv.max_translation_count() == 1
    assert sorted(conv.translation_counts.values()) == [1] * len(conv.spans)  # the last span went to A above
    assert [s.writer for s in conv.spans] == ["A", "B", "A", "B"]
    for name, tok, plain in (("A", tok_a, False), ("B", tok_b, True)):
        ids = rendering_ids(tok, conv.messages, plain)
        assert conv.lines[name].n_tokens == len(ids) == len(conv.transcripts[name].ids)
        assert conv.transcripts[name].ids == ids
        translated = [seg for seg in conv.lines[name].segments if seg.hops]
        assert translated and all(seg.hops == 1 and seg.origin != name for seg in translated)
    switches = [e for e in conv.events if getattr(e, "how", None) == "segment"]
    assert len(switches) == 4 and all(e.n_tokens > 0 for e in switches)


def test_segment_entries_of_a_message_match_its_writers_content_tokens(pair):
    conv = play(conversation(pair, "segment"), turns=2)
    conv.switch_to("A")
    for m in range(len(conv.messages)):
        writer = next(s.writer for s in conv.spans if s.start <= m < s.end)
        receiver = "B" if writer == "A" else "A"
        src, _ = conv.transcripts[writer].message_tokens(m)
        rcv, _ = conv.transcripts[receiver].message_tokens(m)
        line = conv.lines[receiver]
        inside = [p for p in line.positions.tolist() if rcv and rcv[0] <= p <= rcv[-1]]
        # One entry per source content token, rotated at receiver content positions, non-decreasing.
        assert len(inside) == len(src)
        assert set(inside) <= set(rcv) and inside == sorted(inside)


# ------------------------------------------- 3. one switch: the same cache as the single-prefix path of cross.py


def with_token_identity(translator, target_side, seed=3, scale=0.1):
    """`translator`'s assignment with random maps that also read the target's embedding of the aligned ids."""
    inputs = with_tokens(translator.inputs)
    width = target_side.model.config.hidden_size
    out = Translator(translator.assignment, translator.d_src + width, translator.d_tgt, translator.point, inputs, "ids")
    g = torch.Generator().manual_seed(seed)
    for name in out.objects:
        for layer in range(out.n_target_layers):
            out.set_weight(name, layer, scale * torch.randn(out.weight(name, layer).shape, generator=g))
    out.token_module = TokenIdentity("ids", target_embedding(target_side.model), None)
    return out


@pytest.mark.parametrize("token_identity", [False, True])
def test_one_switch_equals_the_single_prefix_mixed_cache(pair, tok_a, tok_b, token_identity):
    sides, formats, translators = pair
    if token_identity:  # the receiver's ids of the aligned tokens come from its transcript, not from the sample
        translators = {**translators, ("A", "B"): with_token_identity(translators[("A", "B")], sides["B"])}
        pair = (sides, formats, translators)
    conv = conversation(pair, "segment", unaligned="prefill")
    conv.append(CONVERSATIONS[0][:4])  # system, user, assistant, user
    conv.generate(GenerationSettings(max_new_tokens=4))
    conv.switch_to("B")
    sample = cross_prompt(tok_a, tok_b, conv.messages, max_prefix_tokens=256)
    assert sample is not None
    # B's line covers its rendering of the history; the single-prefix sample adds B's generation header.
    q = sample.target_ids.numel()
    assert sample.target_ids[:-1].tolist() == conv.transcripts["B"].ids and conv.lines["B"].n_tokens == q - 1
    translated = [p for seg in conv.lines["B"].segments if seg.hops
                  for p in conv.lines["B"].positions.tolist() if seg.start <= p < seg.end]
    assert translated == sample.positions.tolist()
    point = translators[("A", "B")].point
    with torch.no_grad():
        tensors = translated_tensors(translators[("A", "B")], source_capture(sides["A"], sample, point), sample)
        reference = mixed_cache(sides["B"].model, sides["B"].layout, sample, tensors, point)
        mine = conv.lines["B"].to_cache(sides["B"])
        for i in range(sides["B"].layout.n_layers):
            torch.testing.assert_close(mine.layers[i].keys, reference.layers[i].keys, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(mine.layers[i].values, reference.layers[i].values, atol=2e-4, rtol=1e-4)
        header = sample.target_ids[-1:]
        got = decode_step(sides["B"].model, mine, header, position=q - 1, logits_to_keep=1)[-1]
        want = decode_step(sides["B"].model, reference, header, position=q - 1, logits_to_keep=1)[-1]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- 4. naive compounds


def test_naive_retranslates_translated_content(pair):
    conv = play(conversation(pair, "naive"), turns=4)
    assert conv.max_translation_count() > 1
    assert max(seg.hops for line in conv.lines.values() for seg in line.segments) > 1
    for name in ("A", "B"):
        assert conv.lines[name].n_tokens <= len(conv.transcripts[name].ids)


def test_refresh_rebuilds_a_line_natively(pair):
    conv = play(conversation(pair, "segment", refresh_every=1), turns=4)
    # B received translated content at turn 1; by its next switch (turn 3) one turn had passed: rebuilt natively.
    assert [getattr(e, "how", None) for e in conv.events if hasattr(e, "how")] == ["segment", "segment", "refresh"]
    assert all(seg.hops == 0 for seg in conv.lines["B"].segments)
    assert conv.lines["B"].n_tokens == len(conv.transcripts["B"].ids)


# -------------------------------------------------------------------------------------------------- 6. bad input


def test_bad_arguments_are_config_errors(pair):
    sides, formats, translators = pair
    with pytest.raises(ConfigError, match="segmnt.*did you mean 'segment'"):
        CrossConversation(sides, formats, holder="A", translators=translators, mode="segmnt")
    with pytest.raises(ConfigError, match="unaligned must be one of"):
        CrossConversation(sides, formats, holder="A", translators=translators, unaligned="skip")
    with pytest.raises(ConfigError, match="one ModelFormat per model"):
        CrossConversation(sides, {"A": formats["A"]}, holder="A", translators=translators)
    with pytest.raises(ConfigError, match="unknown model 'C'.*models: A, B"):
        conversation(pair, "segment").switch_to("C")
    with pytest.raises(ConfigError, match="append the prompt"):
        conversation(pair, "segment").generate(SETTINGS)


def test_translators_of_the_wrong_pair_are_refused(pair):
    sides, formats, translators = pair
    swapped = {("A", "B"): translators[("B", "A")], ("B", "A"): translators[("A", "B")]}
    with pytest.raises(PairMismatchError, match="does not fit this model pair"):
        CrossConversation(sides, formats, holder="A", translators=swapped)
    with pytest.raises(PairMismatchError, match="identity"):
        CrossConversation(sides, formats, holder="A")  # no translators: identity between different caches


def test_a_template_that_rewrites_earlier_turns_is_refused(pair, tok_a):
    sides, formats, translators = pair
    counting = ModelFormat(tok_a, lambda messages, generation_prompt: f"{len(messages)} turns\n" + render_chat(
        tok_a, messages, generation_prompt=generation_prompt))
    conv = CrossConversation(sides, {**formats, "A": counting}, holder="A", translators=translators)
    conv.append(CONVERSATIONS[1][:1])
    with pytest.raises(ConfigError, match="re-renders earlier turns"):
        conv.generate(SETTINGS)


@pytest.fixture(scope="module")
def word_pair(tok_a):
    """A (byte-level: spans include the space before a word) and W (word-level: spans exclude it)."""
    word = tiny_tokenizer()
    sides = {"A": _side("llama", tok_a, 1), "W": _side("llama", word, 3)}
    formats = {"A": model_format(tok_a), "W": model_format(word)}
    translators = {("A", "W"): random_translator(sides["A"].layout, sides["W"].layout),
                   ("W", "A"): random_translator(sides["W"].layout, sides["A"].layout)}
    return sides, formats, translators


def test_content_the_tokenizations_cover_differently_is_an_alignment_error(word_pair):
    sides, formats, translators = word_pair
    conv = CrossConversation(sides, formats, holder="A", translators=translators)
    conv.append([{"role": "user", "content": "w1 w2 w3"}])
    conv.generate(SETTINGS)
    with pytest.raises(AlignmentError, match="message 0 .*between A and W.*do not reconstruct the same characters"):
        conv.switch_to("W")


def test_unaligned_prefill_lets_the_receiver_read_the_message_itself(word_pair, tok_a):
    sides, formats, translators = word_pair
    conv = CrossConversation(sides, formats, holder="A", translators=translators, unaligned="prefill")
    conv.append([{"role": "user", "content": "w1 w2 w3"}])
    conv.generate(SETTINGS)
    conv.switch_to("W")
    assert conv.fallbacks and conv.fallbacks[0][:2] == (0, "W")
    line = conv.lines["W"]
    assert line.n_tokens == len(conv.transcripts["W"].ids)
    # Message 0 was read natively by W; only A's answer (when it aligned) arrived translated.
    user = conv.transcripts["W"].message_tokens(0)[0]
    assert all(seg.hops == 0 for seg in line.segments if seg.start <= user[0] < seg.end)


# ---------------------------------------------------------------------- 5. bench multiturn on a cross-tokenizer pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, tok_a, tok_b):
    """Local model directories of A and B (long positions: the hand-off openings are ~500 characters) and random
    translator artifacts for both directions, pinned to the loaded pair's signatures."""
    from infra.zoo import load_model, model_signature, tokenizer_fingerprint
    from translators.artifact import save_translator

    root = tmp_path_factory.mktemp("cross-multiturn")
    dirs = {}
    for name, family, tok, seed in (("a", "llama", tok_a, 1), ("b", "gemma3", tok_b, 2)):
        model = tiny_model(family, seed, vocab_size=len(tok), max_position_embeddings=4096)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    loaded = {name: load_model(path) for name, path in dirs.items()}
    signatures = {name: model_signature(m) for name, m in loaded.items()}
    # The same target, but as if it had been fitted while B read A's tokenizer.
    signatures["b_other_tokenizer"] = {**signatures["b"], "tokenizer_sha256": tokenizer_fingerprint(tok_a)}
    artifacts = {}
    for key, src, tgt in (("ab", "a", "b"), ("ba", "b", "a"), ("ab_other", "a", "b_other_tokenizer")):
        translator = random_translator(loaded[src].layout, loaded[tgt[0]].layout)
        artifacts[key] = str(save_translator(translator, root / key, source=signatures[src], target=signatures[tgt],
                                             fit={"stage": "test"}))
    return dirs, artifacts


def test_bench_multiturn_runs_a_cross_tokenizer_pair(pair_dirs):
    from tasks.multiturn import run_multiturn

    dirs, artifacts = pair_dirs
    result = run_multiturn(dirs["a"], dirs["b"], translator_ab=artifacts["ab"], translator_ba=artifacts["ba"],
                           n_conversations=1, turns=3, max_new_tokens=2)
    assert result["cross_tokenizer"] is True
    assert set(result["modes"]) == {"reprefill", "segment", "naive"}
    for row in result["modes"].values():
        assert len(row["per_turn"]) == 3 and all(0.0 <= x <= 1.0 for x in row["per_turn"])
    assert result["modes"]["reprefill"]["max_times_a_span_was_translated"] == 0
    assert result["modes"]["segment"]["max_times_a_span_was_translated"] == 1
    assert result["modes"]["naive"]["max_times_a_span_was_translated"] > 1


def test_cli_bench_multiturn_prints_the_table_for_a_cross_pair(pair_dirs):
    from flows.cli import app

    dirs, artifacts = pair_dirs
    args = ["bench", "multiturn", dirs["a"], dirs["b"], "--translator-ab", artifacts["ab"], "--translator-ba",
            artifacts["ba"], "--conversations", "1", "--turns", "2"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    for mode in ("reprefill", "segment", "naive"):
        assert mode in out.output
    assert "max translations of a span" in out.output
    as_json = CliRunner().invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    last = as_json.stdout.strip().splitlines()[-1]  # the one JSON line (model loading may draw progress before it)
    assert json.loads(last)["modes"]["segment"]["max_times_a_span_was_translated"] == 1


def test_bench_multiturn_refuses_a_translator_fitted_with_another_tokenizer(pair_dirs):
    from tasks.multiturn import run_multiturn

    dirs, artifacts = pair_dirs
    with pytest.raises(PairMismatchError, match="another target model: target.tokenizer_sha256"):
        run_multiturn(dirs["a"], dirs["b"], translator_ab=artifacts["ab_other"], translator_ba=artifacts["ba"],
                      n_conversations=1, turns=2)
