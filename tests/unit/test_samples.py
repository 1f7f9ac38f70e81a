import logging

import pytest
import torch

from infra.conversations import Corpus, TextDocument, load_conversations
from infra.samples import (Sample, build_samples, chat_samples, check_prefix_lengths, flatten_conversation,
                           split_by_conversation, text_samples)
from translators.errors import ConfigError, PrefixTooLongError

HEADER = "<|im_start|>assistant\n"
THINK = "<think>\n\n</think>\n\n"
EOT = "<|im_end|>\n"

_TURNS = "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
# ChatML without reasoning: ignores enable_thinking.
PLAIN_TEMPLATE = _TURNS + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
# Qwen3-like generation prompt: the empty-reasoning placeholder when enable_thinking is false. The rendered
# final answer carries no placeholder, so the continuation must be found by searching for the answer.
THINKING_TEMPLATE = PLAIN_TEMPLATE.removesuffix("{%- endif %}") + (
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
# As the real Qwen3 template: the last assistant turn is rendered with the (empty) reasoning block too.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
) + THINKING_TEMPLATE.removeprefix(_TURNS)

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My cat is called Biscuit."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is my cat called?"},
        {"role": "assistant", "content": "Biscuit."}]

_TRAINING_TEXT = ["My cat is called Biscuit and she is 7.", "What is the code for ORCHID-27? The code is 4817.",
                  "Be brief. Noted. Understood. Hello there, how are you today?",
                  "The quick brown fox jumps over the lazy dog."]


def make_tokenizer(chat_template=None, bos=False):
    """A small byte-level BPE tokenizer (exact round trips) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<s>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_TRAINING_TEXT * 3, trainer)
    extra = {}
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 5)])
        extra["bos_token"] = "<s>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", **extra)
    tokenizer.chat_template = chat_template
    return tokenizer


def decode(tokenizer, ids):
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


@pytest.fixture(scope="module")
def plain():
    return make_tokenizer(PLAIN_TEMPLATE)


@pytest.fixture(scope="module")
def corpus():
    return load_conversations("embedded:40", seed=0).items


def test_prefix_ends_at_the_assistant_header_and_continuation_is_answer_plus_end_of_turn(plain):
    samples = chat_samples([CHAT], plain, seed=0, samples_per_conversation=2)
    assert [s.conversation for s in samples] == [0, 0]
    for sample, turn in zip(samples, (2, 4)):
        assert sample.prefix_ids.dtype == sample.continuation_ids.dtype == torch.int64
        expected = plain.apply_chat_template(CHAT[:turn], tokenize=False, add_generation_prompt=True)
        assert decode(plain, sample.prefix_ids) == expected and expected.endswith(HEADER)
        assert decode(plain, sample.continuation_ids) == CHAT[turn]["content"] + EOT


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, QWEN3_TEMPLATE], ids=["placeholder-in-prompt", "qwen3"])
def test_thinking_placeholder_ends_the_prefix_not_the_continuation(template):
    tokenizer = make_tokenizer(template)
    samples = chat_samples([CHAT], tokenizer, seed=0, samples_per_conversation=2)
    assert len(samples) == 2
    for sample, turn in zip(samples, (2, 4)):
        prefix, continuation = decode(tokenizer, sample.prefix_ids), decode(tokenizer, sample.continuation_ids)
        assert prefix.endswith(HEADER + THINK)
        assert continuation == CHAT[turn]["content"] + EOT
        assert not continuation.startswith("<think>")


def test_caps_keep_the_end_of_the_prefix_and_the_start_of_the_continuation(plain, corpus):
    full = chat_samples(corpus, plain, seed=5)
    capped = chat_samples(corpus, plain, seed=5, max_prefix_tokens=6, max_continuation_tokens=2)
    assert len(full) == len(capped)
    for a, b in zip(full, capped):
        assert torch.equal(b.prefix_ids, a.prefix_ids[-6:]) and torch.equal(b.continuation_ids, a.continuation_ids[:2])
    assert decode(plain, full[0].prefix_ids).endswith(decode(plain, capped[0].prefix_ids))


def test_sampling_is_deterministic_and_seed_dependent(plain, corpus):
    first, again = chat_samples(corpus, plain, seed=1), chat_samples(corpus, plain, seed=1)
    assert [(s.conversation, s.prefix_ids.tolist(), s.continuation_ids.tolist()) for s in first] == \
           [(s.conversation, s.prefix_ids.tolist(), s.continuation_ids.tolist()) for s in again]
    other = chat_samples(corpus, plain, seed=2)
    turns = lambda samples: [(s.conversation, s.prefix_ids.numel()) for s in samples]  # noqa: E731
    assert turns(first) != turns(other)
    # A sample depends only on its own conversation and index: appending conversations changes none.
    longer = chat_samples(list(corpus) + [CHAT], plain, seed=1)
    assert [s.prefix_ids.tolist() for s in longer[:-1]] == [s.prefix_ids.tolist() for s in first]


def test_conversations_without_an_eligible_turn_are_skipped_and_logged(plain, caplog):
    lonely = [{"role": "assistant", "content": "I speak first."}]
    with caplog.at_level(logging.WARNING, logger="infra.samples"):
        samples = chat_samples([lonely, CHAT], plain, seed=0)
    assert [s.conversation for s in samples] == [1]
    assert "1 of 2 items gave no sample" in caplog.text
    with pytest.raises(ConfigError, match="empty dataset: none of 1 conversations"):
        chat_samples([lonely], plain, seed=0)


def test_template_errors_are_quoted_when_nothing_renders():
    tokenizer = make_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ConfigError, match="roles must alternate"):
        chat_samples([CHAT], tokenizer, seed=0)


def test_tokenizer_without_chat_template_points_to_plain_text():
    with pytest.raises(ConfigError, match="no chat template: use a plain-text source"):
        chat_samples([CHAT], make_tokenizer(None), seed=0)


@pytest.mark.parametrize("kwargs", [{"max_prefix_tokens": 0}, {"max_continuation_tokens": -1},
                                    {"samples_per_conversation": 1.5}, {"seed": -1}])
def test_bad_chat_arguments(plain, kwargs):
    with pytest.raises(ConfigError, match="must be a"):
        chat_samples([CHAT], plain, **{"seed": 0, **kwargs})


def test_text_windows_have_exact_lengths_and_skip_short_documents(caplog):
    tokenizer = make_tokenizer(None)
    documents = [TextDocument(" ".join(_TRAINING_TEXT * 4)), TextDocument("too short"), " ".join(_TRAINING_TEXT * 2)]
    with caplog.at_level(logging.WARNING, logger="infra.samples"):
        samples = text_samples(documents, tokenizer, seed=0, prefix_tokens=20, continuation_tokens=7,
                               samples_per_document=3)
    assert [s.conversation for s in samples] == [0, 0, 0, 2, 2, 2]
    assert all(s.prefix_ids.shape == (20,) and s.continuation_ids.shape == (7,) for s in samples)
    assert "1 documents shorter than a window" in caplog.text
    # Each window is contiguous text of its document.
    full = tokenizer(documents[0].text, add_special_tokens=False)["input_ids"]
    window = samples[0].prefix_ids.tolist() + samples[0].continuation_ids.tolist()
    assert any(full[i: i + 27] == window for i in range(len(full) - 26))
    again = text_samples(documents, tokenizer, seed=0, prefix_tokens=20, continuation_tokens=7, samples_per_document=3)
    assert [s.prefix_ids.tolist() for s in again] == [s.prefix_ids.tolist() for s in samples]
    with pytest.raises(ConfigError, match=r"empty dataset: none of 1 documents has the 27 tokens.*longest: \d+"):
        text_samples(["too short"], tokenizer, seed=0, prefix_tokens=20, continuation_tokens=7)


def test_text_windows_start_with_bos_when_the_tokenizer_adds_one():
    tokenizer = make_tokenizer(None, bos=True)
    samples = text_samples([" ".join(_TRAINING_TEXT * 3)], tokenizer, seed=0, prefix_tokens=10, continuation_tokens=4)
    assert samples[0].prefix_ids.shape == (10,) and samples[0].prefix_ids[0].item() == tokenizer.bos_token_id
    assert tokenizer.bos_token_id not in samples[0].prefix_ids[1:].tolist()


def test_build_samples_dispatches_on_corpus_kind_and_template(plain):
    chat = Corpus(kind="chat", items=(CHAT, CHAT), name="inline")
    assert decode(plain, build_samples(chat, plain, seed=0)[0].prefix_ids).endswith(HEADER)
    base = make_tokenizer(None)
    flat = build_samples(chat, base, seed=0, prefix_tokens=8, continuation_tokens=4)
    assert [s.conversation for s in flat] == [0, 1] and flat[0].prefix_ids.shape == (8,)
    assert flatten_conversation(CHAT).startswith("System: Be brief.\nUser: My cat is called Biscuit.\nAssistant: ")
    text = Corpus(kind="text", items=(TextDocument(" ".join(_TRAINING_TEXT * 3)),), name="t")
    assert build_samples(text, plain, seed=0, prefix_tokens=8, continuation_tokens=4)[0].continuation_ids.shape == (4,)


def _fake_samples(conversations):
    return [Sample(torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long), c) for c in conversations]


def test_split_by_conversation_is_disjoint_and_deterministic():
    samples = _fake_samples([c for c in range(30) for _ in range(2)])
    train, val = split_by_conversation(samples, val_fraction=0.2, seed=3)
    train_ids, val_ids = {s.conversation for s in train}, {s.conversation for s in val}
    assert not train_ids & val_ids and len(val_ids) == 6 and len(train) + len(val) == len(samples)
    again = split_by_conversation(samples, val_fraction=0.2, seed=3)
    assert [s.conversation for s in again[1]] == [s.conversation for s in val]
    assert {s.conversation for s in split_by_conversation(samples, val_fraction=0.2, seed=4)[1]} != val_ids


def test_split_needs_two_conversations_and_a_sane_fraction():
    with pytest.raises(ConfigError, match=r"from 1 conversation\(s\).*use more data"):
        split_by_conversation(_fake_samples([0, 0, 0]))
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        split_by_conversation(_fake_samples([0, 1]), val_fraction=1.0)


def test_check_prefix_lengths_names_the_sample():
    samples = _fake_samples([0, 1]) + [Sample(torch.zeros(9, dtype=torch.long), torch.zeros(3, dtype=torch.long), 7)]
    check_prefix_lengths(samples, max_positions=12, model_name="tiny")
    with pytest.raises(PrefixTooLongError, match=r"sample 2 \(conversation 7\) has 9 prefix \+ 3 continuation = 12 "
                                                 r"tokens, more than the 11 positions of tiny; 1 of 3"):
        check_prefix_lengths(samples, max_positions=11, model_name="tiny")


def test_real_hh_rlhf_chat_samples(shared_data, plain):
    corpus = load_conversations(str(shared_data / "chat" / "hh-rlhf-harmless-base.test.jsonl.gz"), limit=50)
    samples = chat_samples(list(corpus.items), plain, seed=0, max_prefix_tokens=4096, max_continuation_tokens=4096)
    assert len(samples) == 50
    for sample in samples[:10]:
        answer = decode(plain, sample.continuation_ids)
        assert decode(plain, sample.prefix_ids).endswith(HEADER) and answer.endswith(EOT)
        assert any(m["content"] == answer.removesuffix(EOT) for m in corpus.items[sample.conversation])


def test_real_paul_graham_text_samples_have_exact_lengths(shared_data):
    corpus = load_conversations(str(shared_data / "ruler" / "PaulGrahamEssays.json"), limit=12)
    samples = build_samples(corpus, make_tokenizer(None), seed=0, prefix_tokens=256, continuation_tokens=64,
                            samples_per_item=2)
    assert len(samples) == 24
    assert all(s.prefix_ids.shape == (256,) and s.continuation_ids.shape == (64,) for s in samples)
