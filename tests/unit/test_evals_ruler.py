import json

import pytest

from evals.errors import DataNotFoundError
from evals.ruler import (ANSWER_PREFIX, NEEDLE, QUESTION, build_ruler_items, count_tokens, noise_sentences,
                         score_ruler)
from tiny_configs import tiny_tokenizer
from translators.errors import ConfigError

_TRAINING_TEXT = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
                  "One of the special magic numbers for ancient-lamp is: 1234567.",
                  "What is the special magic number mentioned in the provided text?",
                  "If the world were static, we could have monotonically increasing confidence in our beliefs."]


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE tokenizer (every string encodes; word pieces vary in length like a real one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_TRAINING_TEXT * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _needle(item):
    return NEEDLE.format(key=item.key, value=item.gold)


def _max_unit_tokens(tokenizer, units):
    """Tokens of the longest haystack unit plus its joining space: how far below the target a fit may fall."""
    return max(count_tokens(tokenizer, " " + u) for u in units) + 1


@pytest.mark.parametrize("length", [40, 257, 1500])
def test_noise_items_fit_the_requested_length(bpe, length):
    slack = _max_unit_tokens(bpe, noise_sentences())
    for item in build_ruler_items(bpe, [length], 3, seed=1):
        n = count_tokens(bpe, item.context)
        assert length - slack <= n <= length, (n, length)
        assert item.length == length


def test_needle_present_exactly_once_with_question_and_prefix(bpe):
    items = build_ruler_items(bpe, [300], 4, seed=2)
    for item in items:
        assert item.context.count(_needle(item)) == 1
        assert item.context.count("special magic") == 1
        assert item.question == QUESTION.format(key=item.key)
        assert item.answer_prefix == ANSWER_PREFIX.format(key=item.key)
        assert len(item.gold) == 7 and item.gold.isdigit()
        assert item.prompt().index(item.context) < item.prompt().index(item.question)
    assert len({i.key for i in items}) == 4


def test_depth_is_honoured(bpe):
    depths = [0.0, 0.1, 0.5, 0.9, 1.0]
    items = build_ruler_items(bpe, [1200], 5, depths=depths, seed=3)
    for item, depth in zip(items, depths):
        at = item.context.index(_needle(item))
        fraction = at / (len(item.context) - len(_needle(item)))  # share of haystack text before the needle
        assert item.depth == depth
        assert abs(fraction - depth) < 0.03, (fraction, depth)
    assert items[0].context.startswith(_needle(items[0]))
    assert items[-1].context.endswith(_needle(items[-1]))


def test_default_depths_spread_over_the_context(bpe):
    assert [i.depth for i in build_ruler_items(bpe, [100], 3)] == [0.0, 0.5, 1.0]


def test_items_are_deterministic_given_the_seed(bpe):
    a = build_ruler_items(bpe, [200, 400], 3, seed=5)
    assert a == build_ruler_items(bpe, [200, 400], 3, seed=5)
    assert [i.gold for i in a] != [i.gold for i in build_ruler_items(bpe, [200, 400], 3, seed=6)]
    assert [i.length for i in a] == [200] * 3 + [400] * 3


def test_word_level_tokenizer_also_fits():
    tok = tiny_tokenizer()  # one token per whitespace word
    for item in build_ruler_items(tok, [120], 2):
        assert 120 - 5 <= count_tokens(tok, item.context) <= 120


def test_score_ruler():
    item = build_ruler_items(tiny_tokenizer(), [60], 1)[0]
    assert score_ruler(f"{item.answer_prefix} {item.gold}.", item) == 1.0
    assert score_ruler(f"The number is {item.gold[:-1]}", item) == 0.0
    assert score_ruler("I don't know.", item) == 0.0


def test_argument_errors(bpe):
    with pytest.raises(ConfigError, match="shorter than the needle"):
        build_ruler_items(bpe, [5], 1)
    with pytest.raises(ConfigError, match="unknown RULER haystack"):
        build_ruler_items(bpe, [100], 1, haystack="books")
    with pytest.raises(ConfigError, match="depths"):
        build_ruler_items(bpe, [100], 2, depths=[0.5, 1.5])
    with pytest.raises(ConfigError, match="essay_path"):
        build_ruler_items(bpe, [100], 1, haystack="essay")


def test_missing_essay_file_names_the_path_and_the_source(bpe, tmp_path):
    missing = tmp_path / "nowhere" / "PaulGrahamEssays.json"
    with pytest.raises(DataNotFoundError) as err:
        build_ruler_items(bpe, [100], 1, haystack="essay", essay_path=missing)
    assert str(missing) in str(err.value) and "RULER" in str(err.value)


def test_small_essay_file(bpe, tmp_path):
    path = tmp_path / "essay.json"
    text = " ".join(f"Sentence number {i} talks about startups and essays." for i in range(200))
    path.write_text(json.dumps({"text": text}))
    item = build_ruler_items(bpe, [300], 1, haystack="essay", essay_path=path, depths=[0.5])[0]
    assert item.context.count(_needle(item)) == 1 and item.haystack == "essay"
    assert 300 - _max_unit_tokens(bpe, text.split()) <= count_tokens(bpe, item.context) <= 300
    with pytest.raises(ConfigError, match="too short"):
        build_ruler_items(bpe, [100_000], 1, haystack="essay", essay_path=path)
    path.write_text(json.dumps({"body": text}))
    with pytest.raises(ConfigError, match="text"):
        build_ruler_items(bpe, [300], 1, haystack="essay", essay_path=path)


def test_paul_graham_essay_haystack(bpe, shared_data):
    path = shared_data / "ruler" / "PaulGrahamEssays.json"
    items = build_ruler_items(bpe, [2000], 2, haystack="essay", essay_path=path, seed=0)
    words = json.loads(path.read_text())["text"].split()[:3000]
    slack = _max_unit_tokens(bpe, words)
    for item in items:
        assert 2000 - slack <= count_tokens(bpe, item.context) <= 2000
        assert item.context.count(_needle(item)) == 1
        assert item.context.replace(_needle(item) + " ", "").startswith(" ".join(words[:20]))
