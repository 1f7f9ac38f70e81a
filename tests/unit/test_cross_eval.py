"""Evaluating cross-tokenizer pairs (KV-Lingo App. K): reading a prefix under a condition, the CrossConditions the
benchmarks score, needle_codes, the cross switch-speed row and the benchmark selection of `tasks.evaluate`.

Tokenizers and tiny models come from tests/unit/test_cross_tokenizer.py: A is a byte-level BPE with a ChatML
template (no BOS), B a "▁word" BPE without a template whose post-processor adds <s>. Loaded models are
SimpleNamespace stand-ins for `infra.zoo.LoadedModel` (.name, .model, .tokenizer, .layout, .identity).

References are independent of the code under test: greedy decoding by re-running the model over the whole
sequence at every step (no cache), log-probabilities from one plain forward, and the chat formats written out by
hand (ChatML through the tokenizer's own template, B's plain "Role: content" lines).
"""

import re
from types import SimpleNamespace

import pytest
import torch
from test_cross_tokenizer import (  # tok_a, tok_b: the two tokenizer fixtures, shared
    CONVERSATIONS, byte_level_chatml, tiny_model, tok_a, tok_b)

import evals.benchmarks.needle_codes as needle_codes
from evals.benchmarks import BenchContext, get
from evals.conditions import empty_prefix, source_native, target_native
from evals.cross_conditions import CrossCondition, answer_logprob, cross_conditions, generate_messages
from evals.speed import measure_speed_cross
from infra.chat import stop_ids
from infra.cross_samples import cross_prompt, cross_prompt_of_length, render_prefix
from infra.pairs import same_tokenizer
from infra.prompts import prompt_of_length
from tasks.evaluate import cross_tokenizer_specs
from translators.cross import continuation_logprob, generate_cross
from translators.errors import ConfigError, PairMismatchError
from translators.generation import GenerationSettings
from translators.layout import cache_layout
from translators.objects import cache_objects
from translators.stage1 import Side, candidate_layers
from translators.switch import identity_translator
from translators.translator import Translator

# ------------------------------------------------------------------------------------------------------ helpers


def loaded(name, family, tokenizer, tokenizer_id, seed, **fields):
    """A LoadedModel stand-in; `tokenizer_id` plays the tokenizer's sha256 in the identity."""
    model = tiny_model(family, seed, vocab_size=len(tokenizer), **fields)
    return SimpleNamespace(name=name, model=model, tokenizer=tokenizer, layout=cache_layout(model),
                           identity={"tokenizer_sha256": tokenizer_id})


def side(m):
    return Side(m.model, m.layout)


@pytest.fixture(scope="module")
def model_a(tok_a):
    return loaded("tiny-a", "llama", tok_a, "sha-a", seed=1)


@pytest.fixture(scope="module")
def model_b(tok_b):
    return loaded("tiny-b", "gemma3", tok_b, "sha-b", seed=2)  # sliding window 6 on 3 of 4 layers


def random_translator(src, tgt, seed=0, scale=0.1):
    """A depth-assigned ν=1 translator with random maps (fits the layouts; its output is arbitrary)."""
    candidates = candidate_layers(src, tgt, "depth", 1)
    names = [obj.name for obj in cache_objects(tgt)]
    translator = Translator({name: candidates for name in names}, src.kv_width, tgt.kv_width, "pre_norm")
    g = torch.Generator().manual_seed(seed)
    for name in names:
        for layer, sources in candidates.items():
            translator.set_weight(name, layer, scale * torch.randn(tgt.kv_width, len(sources) * src.kv_width,
                                                                   generator=g))
    return translator


@pytest.fixture(scope="module")
def translator_ab(model_a, model_b):
    return random_translator(model_a.layout, model_b.layout)


def plain_b_ids(tok_b, messages):
    """B's rendering written out by hand: "Role: content" lines, then the header; <s> from its post-processor."""
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return tok_b(text)["input_ids"]


def chatml_ids(tok_a, messages):
    """A's rendering through its own template (the template writes everything; no tokenizer specials)."""
    text = tok_a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok_a(text, add_special_tokens=False)["input_ids"]


def reference_greedy(model, ids, max_new_tokens, stops=()):
    """Greedy decoding with the whole sequence re-read at every step (no cache); a stop id is kept, last."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
            if token in stops:
                break
    return out


def reference_answer(model, tokenizer, ids, max_new_tokens):
    """The answer text a benchmark gets: greedy tokens without the final stop id, decoded by `tokenizer`."""
    stops = set(stop_ids(tokenizer))
    out = reference_greedy(model, ids, max_new_tokens, stops)
    if out and out[-1] in stops:
        out = out[:-1]
    return tokenizer.decode(out, skip_special_tokens=True)


def reference_logprob(model, prefix_ids, continuation_ids):
    """Σ log p(continuation | prefix) in nats from one plain forward over prefix + continuation[:-1]."""
    prefix, cont = list(prefix_ids), list(continuation_ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + cont[:-1]]), use_cache=False).logits[0, -len(cont):]
    return float(torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(cont).view(-1, 1)).sum())


# ------------------------------------------------------ 1. prefix_cache / generate_cross against plain decoding


@pytest.mark.parametrize("family, which", [("llama", "a"), ("gemma3", "a"), ("gemma3", "b")])
def test_self_pair_generation_and_logprob_equal_plain_decoding(tok_a, tok_b, family, which):
    tok = tok_a if which == "a" else tok_b
    me = loaded("self", family, tok, "sha", seed=3)  # gemma3: sliding window 6, prompts of 40..70 tokens
    s = side(me)
    identity = identity_translator(me.layout, "pre_norm")
    settings = GenerationSettings(max_new_tokens=10)  # no stop ids: always 10 tokens
    for messages in (CONVERSATIONS[0], CONVERSATIONS[4]):
        context, answer = messages[:-1], messages[-1]["content"]
        answer_ids = tok(" " + answer, add_special_tokens=False)["input_ids"]
        sample = cross_prompt(tok, tok, context, max_prefix_tokens=256, continuation_ids=answer_ids)
        # Same tokenizer: every content token is translated 1:1 at its own position.
        assert torch.equal(sample.source_ids, sample.target_ids)
        assert torch.equal(sample.positions, sample.translated)
        prefix = sample.target_ids.tolist()
        assert prefix == (chatml_ids(tok, context) if which == "a" else plain_b_ids(tok, context))
        if family == "gemma3":
            assert len(prefix) > 4 * me.model.config.sliding_window

        native = generate_cross("target_native", None, s, sample, None, settings).token_ids
        switched = generate_cross("translated", s, s, sample, identity, settings).token_ids
        floor = generate_cross("empty_prefix", None, s, sample, None, settings).token_ids
        assert native == reference_greedy(me.model, prefix, 10)
        assert switched == native
        assert floor == reference_greedy(me.model, prefix[-1:], 10)  # only the last prefix token, at position 0
        assert floor != native  # the floor really reads less (guards the comparison above)

        lp_ref = reference_logprob(me.model, prefix, answer_ids)
        lp_native = continuation_logprob("target_native", None, s, sample, None)
        lp_switched = continuation_logprob("translated", s, s, sample, identity)
        lp_floor = continuation_logprob("empty_prefix", None, s, sample, None)
        assert lp_native == pytest.approx(lp_ref, abs=1e-4)
        assert lp_switched == pytest.approx(lp_ref, abs=1e-4)
        assert lp_floor == pytest.approx(reference_logprob(me.model, prefix[-1:], answer_ids), abs=1e-4)
        assert abs(lp_floor - lp_ref) > 0.1


def test_prefix_cache_refuses_unknown_condition_and_missing_translator(tok_a):
    me = loaded("self", "llama", tok_a, "sha", seed=3)
    sample = cross_prompt(tok_a, tok_a, CONVERSATIONS[1][:1], max_prefix_tokens=256, continuation_ids=[5])
    with pytest.raises(ConfigError, match="translator"):
        continuation_logprob("translated", side(me), side(me), sample, None)
    with pytest.raises(ConfigError, match="unknown condition 'source_native'"):
        continuation_logprob("source_native", None, side(me), sample, None)


# -------------------------------------------------------------------------------- 2. CrossCondition validation


def test_cross_condition_validation(model_a, model_b, translator_ab):
    with pytest.raises(ConfigError, match="identity"):
        CrossCondition("translated", model_a, model_b)
    wrong = identity_translator(model_b.layout)  # reads width 16 from a source whose caches are 32 wide
    with pytest.raises(PairMismatchError, match="does not fit"):
        CrossCondition("translated", model_a, model_b, wrong)
    with pytest.raises(ConfigError, match="unknown condition 'switched'"):
        CrossCondition("switched", model_a, model_b)
    ok = CrossCondition("translated", model_a, model_b, translator_ab)
    assert ok.decoder is model_b and ok.max_prefix_tokens == 256
    src = CrossCondition("source_native", model_a, model_b)
    assert src.decoder is model_a
    with pytest.raises(ConfigError, match="source_native"):
        answer_logprob(src, CONVERSATIONS[1][:1], "The code is 4817.")
    conditions = cross_conditions(model_a, model_b, {"closed_form": translator_ab})
    assert sorted(conditions) == ["closed_form", "empty_prefix", "source_native", "target_native"]
    assert conditions["closed_form"].name == "translated" and conditions["closed_form"].translator is translator_ab


# ---------------------------------------------------------------------------------- 3. generate_messages (A→B)


def test_generate_messages_under_each_condition(model_a, model_b, translator_ab, tok_a, tok_b):
    conditions = cross_conditions(model_a, model_b, {"translated": translator_ab})
    messages = CONVERSATIONS[0][:4]  # system, user, assistant, user
    n = 12
    out = {name: generate_messages(c, messages, n) for name, c in conditions.items()}
    assert all(isinstance(text, str) for text in out.values())
    ids_a, ids_b = chatml_ids(tok_a, messages), plain_b_ids(tok_b, messages)
    # source_native: A answers from its own (ChatML) rendering, decoded by A's tokenizer.
    assert out["source_native"] == reference_answer(model_a.model, tok_a, ids_a, n)
    # target_native: B answers from its own (plain, <s>) rendering, decoded by B's tokenizer.
    assert out["target_native"] == reference_answer(model_b.model, tok_b, ids_b, n)
    # empty_prefix: B reads only the last token of its rendering.
    assert out["empty_prefix"] == reference_answer(model_b.model, tok_b, ids_b[-1:], n)
    # The decoder's tokenizer matters: A's tokens decoded by B would read differently.
    a_tokens = reference_greedy(model_a.model, ids_a, n, set(stop_ids(tok_a)))
    assert tok_b.decode([t for t in a_tokens if t < len(tok_b)], skip_special_tokens=True) != out["source_native"]
    # The translated answer is B's (deterministic) and differs from the floor (its cache carries something).
    assert generate_messages(conditions["translated"], messages, n) == out["translated"]
    assert out["translated"] != out["empty_prefix"]


def test_generate_messages_is_none_when_the_conversation_does_not_fit(model_a, model_b, translator_ab, tok_b):
    conditions = cross_conditions(model_a, model_b, {"translated": translator_ab})
    long = [{"role": "user", "content": " ".join(["The quick brown fox jumps over the lazy dog."] * 30)}]
    for name, condition in conditions.items():
        assert generate_messages(condition, long, 4) is None, name
    # Boundary: target prefix q plus the answer must fit the 256 positions both models read.
    short = CONVERSATIONS[1][:1]
    q = len(plain_b_ids(tok_b, short))
    assert generate_messages(conditions["target_native"], short, 256 - q + 1) is None
    assert answer_logprob(conditions["target_native"], short, "x " * 300) is None


def test_answer_logprob_tokenizes_the_answer_as_the_render_continues(tok_b):
    # Target: byte-level BPE without a template, so its format is "User: …\nAssistant:" and the answer follows
    # after a space ("ĠYes" …, as cross_sample's training continuations are tokenized).
    plain_bytes = byte_level_chatml()
    plain_bytes.chat_template = None
    source = loaded("tiny-b", "llama", tok_b, "sha-b", seed=1)
    target = loaded("tiny-bytes", "llama", plain_bytes, "sha-bytes", seed=2)
    messages, answer = CONVERSATIONS[5][:1], CONVERSATIONS[5][1]["content"]
    prefix = plain_bytes("User: Is water wet?\nAssistant:", add_special_tokens=False)["input_ids"]
    natural = plain_bytes(" " + answer, add_special_tokens=False)["input_ids"]
    expected = reference_logprob(target.model, prefix, natural)
    got = answer_logprob(CrossCondition("target_native", source, target), messages, answer)
    assert got == pytest.approx(expected, abs=1e-4)


# --------------------------------------------------------------------------------------------- 4. needle_codes


def test_code_items_are_deterministic_and_cover_every_cell():
    items = needle_codes.code_items(6, seed=3)
    assert items == needle_codes.code_items(6, seed=3)
    assert [i.code for i in items] != [i.code for i in needle_codes.code_items(6, seed=4)]
    assert {(i.length, i.depth) for i in items} == {(n, d) for n in needle_codes.LENGTHS for d in needle_codes.DEPTHS}
    for item in items:
        assert re.fullmatch(r"\d{6}", item.code)
        assert item.haystack.count(item.code) == 1 and item.code not in item.plain
        needle = f"The secret code is {item.code}."
        sentences = re.split(r"(?<=\.) ", item.haystack)
        assert len(sentences) == item.length + 1
        assert sentences.index(needle) == round(item.depth * item.length)
        assert " ".join(s for s in sentences if s != needle) == item.plain
        assert item.code in item.answer
        content = item.messages()[0]["content"]
        assert content.startswith(item.haystack) and content.endswith(needle_codes.QUESTION)
        assert item.plain in item.messages(with_needle=False)[0]["content"]


@pytest.fixture
def short_haystacks(monkeypatch):
    monkeypatch.setattr(needle_codes, "LENGTHS", (2, 3))  # haystacks of 60..90 tokens for 256-position models


def test_needle_codes_same_tokenizer_gaps_equal_plain_logprobs(short_haystacks, tok_a):
    source = loaded("tiny-a1", "llama", tok_a, "sha-a", seed=1)
    target = loaded("tiny-a2", "llama", tok_a, "sha-a", seed=5)
    assert same_tokenizer(source, target)
    context = BenchContext(source=source, target=target, seed=0)
    limit = 3
    native = needle_codes.SPEC.run(context, target_native(side(target)), limit)
    floor = needle_codes.SPEC.run(context, empty_prefix(side(target)), limit)
    src = needle_codes.SPEC.run(context, source_native(side(source)), limit)
    items = needle_codes.code_items(limit, seed=0)
    gaps = []
    for i, item in enumerate(items):
        answer_ids = tok_a(item.answer, add_special_tokens=False)["input_ids"]
        with_ids, without_ids = chatml_ids(tok_a, item.messages(True)), chatml_ids(tok_a, item.messages(False))
        lp_with = reference_logprob(target.model, with_ids, answer_ids)
        lp_without = reference_logprob(target.model, without_ids, answer_ids)
        lp_floor = reference_logprob(target.model, with_ids[-1:], answer_ids)
        assert native[f"gap/{i}"] == pytest.approx(lp_with - lp_without, abs=1e-4)
        assert floor[f"gap/{i}"] == pytest.approx(lp_floor - lp_without, abs=1e-4)
        gaps.append(lp_with - lp_without)
    assert set(native) == {f"{kind}/{i}" for kind in ("recall", "gap") for i in range(limit)}
    assert all(score in (0.0, 1.0) for key, score in native.items() if key.startswith("recall/"))
    assert set(src) == {f"recall/{i}" for i in range(limit)} and src.extra == {}
    # gap_share is reported when the native gap is positive (it is here: the reference says so).
    assert sum(gaps) > 0
    assert native.extra["gap_share"] == pytest.approx(1.0, abs=1e-9)
    expected_floor = sum(floor[f"gap/{i}"] for i in range(limit)) / sum(gaps)
    assert floor.extra["gap_share"] == pytest.approx(expected_floor, rel=1e-4)


def test_needle_codes_cross_pair(short_haystacks, model_a, model_b, translator_ab, tok_b):
    # Seed 1: its items' native gaps are all positive (1.44, 0.32, 0.66 nats); with seed 0 they sum below zero
    # (0.43 - 1.79 + 0.19) and gap_share is then left out, as documented.
    context = BenchContext(source=model_a, target=model_b, seed=1)
    assert not same_tokenizer(model_a, model_b)
    conditions = cross_conditions(model_a, model_b, {"translated": translator_ab})
    limit = 3
    scores = {name: needle_codes.SPEC.run(context, c, limit) for name, c in conditions.items()}
    native = scores["target_native"]
    assert set(native) == {f"{kind}/{i}" for kind in ("recall", "gap") for i in range(limit)}
    assert native.extra["gap_share"] == pytest.approx(1.0, abs=1e-6)
    # The native gap against an independent reference: B's plain rendering, one forward.
    gaps = []
    for i, item in enumerate(needle_codes.code_items(limit, seed=1)):
        answer_ids = tok_b(item.answer, add_special_tokens=False)["input_ids"]
        lp_with = reference_logprob(model_b.model, plain_b_ids(tok_b, item.messages(True)), answer_ids)
        lp_without = reference_logprob(model_b.model, plain_b_ids(tok_b, item.messages(False)), answer_ids)
        assert native[f"gap/{i}"] == pytest.approx(lp_with - lp_without, abs=1e-4)
        gaps.append(lp_with - lp_without)
    assert sum(gaps) > 0
    src = scores["source_native"]
    assert set(src) == {f"recall/{i}" for i in range(limit)} and "gap_share" not in src.extra
    for name in ("translated", "empty_prefix"):
        assert {k for k in scores[name] if k.startswith("gap/")} == {f"gap/{i}" for i in range(limit)}
        assert "gap_share" in scores[name].extra


# ------------------------------------------------------------------------------------- 5. measure_speed_cross


def test_measure_speed_cross_on_a_self_pair(tok_a):
    me = loaded("self", "llama", tok_a, "sha", seed=3)
    s = side(me)
    identity = identity_translator(me.layout, "pre_norm")
    sample = cross_prompt_of_length(tok_a, tok_a, 40)
    row = measure_speed_cross(s, s, identity, sample, repeats=2, decode_tokens=2)
    assert row.first_token_match is True
    assert row.n == sample.target_ids.numel()
    # 3 layers × (keys, values) identity maps of 32 × 32, 2 FLOPs per multiply-add.
    assert identity.flops_per_token() == 2 * 3 * 2 * 32 * 32
    assert row.map_flops == identity.flops_per_token() * sample.translated.numel()
    assert 0 < sample.translated.numel() < row.n  # the ChatML boilerplate is prefilled, not translated
    assert row.ratio > 0 and row.repeats == 2
    assert row.flop_ratio == pytest.approx(row.prefill_flops / (row.map_flops + row.step_flops))
    with pytest.raises(ConfigError, match="repeats"):
        measure_speed_cross(s, s, identity, sample, repeats=0)
    with pytest.raises(ConfigError, match="decode_tokens"):
        measure_speed_cross(s, s, identity, sample, decode_tokens=0)


# -------------------------------------------------------------------------------- 6. cross_prompt_of_length


@pytest.mark.parametrize("n", [40, 80])
def test_cross_prompt_of_length_into_a_byte_level_target(tok_a, tok_b, n):
    # Target A is byte-level (no <unk>): the cut text re-renders to n tokens give or take the one token the
    # cut boundary can merge or split (observed: n - 1 or n over seeds 0..2, for sources A and B alike).
    for source in (tok_a, tok_b):
        for seed in (0, 1):
            sample = cross_prompt_of_length(source, tok_a, n, seed=seed)
            assert abs(sample.target_ids.numel() - n) <= 1
            assert sample.target_ids.tolist() == render_prefix(tok_a, [{"role": "user", "content": tok_a.decode(
                sample.target_ids[sample.target_group >= 0].tolist()).strip()}])[1]


@pytest.mark.parametrize("n", [40, 80])
def test_cross_prompt_of_length_into_a_target_with_unk(tok_a, tok_b, n):
    # Target B maps characters outside its alphabet to <unk>, which the decode(skip_special_tokens=True) of the
    # cut prompt drops: the rendering comes out short by about one token per <unk> (observed 33, 38, 37 for
    # n=40 and 67, 76, 71 for n=80 over seeds 0..2), up to one more when a "▁" merges with the next character.
    overhead = len(plain_b_ids(tok_b, [{"role": "user", "content": "x"}])) - 1
    for seed in (0, 1):
        sample = cross_prompt_of_length(tok_a, tok_b, n, seed=seed)
        unk = prompt_of_length(tok_b, n - overhead, seed=seed).tolist().count(tok_b.unk_token_id)
        assert unk > 0
        assert n - 2 * unk - 1 <= sample.target_ids.numel() <= n + 1


def test_cross_prompt_of_length_is_within_a_few_tokens_for_a_target_with_unk(tok_a, tok_b):
    assert abs(cross_prompt_of_length(tok_a, tok_b, 80, seed=0).target_ids.numel() - 80) <= 3


def test_cross_prompt_of_length_refuses_room_for_the_template_only(tok_a, tok_b):
    # B's template around "x" is "<s>User: x\nAssistant:"; the content needs ≥ 2 tokens beyond its overhead.
    overhead = len(plain_b_ids(tok_b, [{"role": "user", "content": "x"}])) - 1
    assert overhead == 5
    with pytest.raises(ConfigError, match="no room for content"):
        cross_prompt_of_length(tok_a, tok_b, overhead + 1)
    cross_prompt_of_length(tok_a, tok_b, overhead + 2)
    overhead_a = len(chatml_ids(tok_a, [{"role": "user", "content": "x"}])) - 1
    with pytest.raises(ConfigError, match=f"{overhead_a}-token template"):
        cross_prompt_of_length(tok_b, tok_a, overhead_a + 1)


# --------------------------------------------------------------------------- 7. benchmarks of a cross pair


def test_cross_tokenizer_specs_keep_the_conversation_benchmarks():
    specs = [get("needle_codes"), get("xquad_multiturn"), get("recall")]
    runnable, errors = cross_tokenizer_specs(specs)
    assert [spec.name for spec in runnable] == ["needle_codes", "xquad_multiturn"]
    assert len(errors) == 1 and errors[0]["benchmark"] == "recall"
    assert "tokenize differently" in errors[0]["error"]
    # The message names every benchmark that can run across tokenizers (suite order), selected or not.
    assert "are xquad_multiturn, needle_codes (--benchmark NAME)" in errors[0]["error"]
    only_ids, errors = cross_tokenizer_specs([get("recall")])
    assert only_ids == [] and "are xquad_multiturn, needle_codes" in errors[0]["error"]
