import gzip
import json
import sys
import types

import pytest
import torch

from infra.conversations import Corpus, TextDocument, load_conversations, split_text
from translators.errors import ConfigError

HH_RECORDS = [
    {"chosen": "\n\nHuman: What is a kite?\n\nAssistant: A toy that flies."
               "\n\nHuman: Thanks!\n\nAssistant: You are welcome.", "rejected": "ignored"},
    # Two Human turns in a row are merged; the answer keeps its inner blank line.
    {"chosen": "\n\nHuman: Hi.\n\nHuman: Still there?\n\nAssistant: Yes.\n\n1. one\n\n2. two"},
    # No assistant content: dropped and counted.
    {"chosen": "\n\nHuman: Hello?\n\nAssistant:"},
]


def write_jsonl(path, records, compress=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_embedded_default_count_size_and_determinism():
    corpus = load_conversations("embedded")
    assert isinstance(corpus, Corpus) and corpus.kind == "chat" and corpus.name == "embedded"
    assert len(corpus.items) == 400 and corpus.dropped == 0
    small = load_conversations("embedded:7", seed=3)
    assert len(small.items) == 7
    assert small.items == load_conversations("embedded:7", seed=3).items
    assert small.items != load_conversations("embedded:7", seed=4).items
    assert len(load_conversations("embedded:7", limit=2).items) == 2


@pytest.mark.parametrize("source", ["embedded:", "embedded:x", "embedded:0"])
def test_bad_embedded_count_is_config_error(source):
    with pytest.raises(ConfigError, match="embedded:N"):
        load_conversations(source)


def test_hh_transcripts_are_split_merged_and_filtered(tmp_path):
    corpus = load_conversations(str(write_jsonl(tmp_path / "hh.jsonl", HH_RECORDS)))
    assert corpus.kind == "chat" and corpus.dropped == 1 and len(corpus.items) == 2
    assert corpus.items[0] == [
        {"role": "user", "content": "What is a kite?"}, {"role": "assistant", "content": "A toy that flies."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
    assert corpus.items[1] == [{"role": "user", "content": "Hi.\n\nStill there?"},
                               {"role": "assistant", "content": "Yes.\n\n1. one\n\n2. two"}]


def test_messages_and_sharegpt_records_gzip_and_json_list(tmp_path):
    messages = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": "4"}]},
                {"messages": [{"role": "user", "content": "only a question"}]}]
    corpus = load_conversations(str(write_jsonl(tmp_path / "m.jsonl.gz", messages, compress=True)))
    assert corpus.items == (messages[0]["messages"],) and corpus.dropped == 1

    sharegpt = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}]
    (tmp_path / "s.json").write_text(json.dumps(sharegpt))
    assert load_conversations(str(tmp_path / "s.json")).items == (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],)


def test_unknown_roles_drop_the_conversation(tmp_path):
    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"},
                             {"role": "assistant", "content": "a"}]},
               {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    corpus = load_conversations(str(write_jsonl(tmp_path / "r.jsonl", records)))
    assert len(corpus.items) == 1 and corpus.dropped == 1


def test_limit_keeps_the_first_usable_items(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(10)]
    corpus = load_conversations(str(write_jsonl(tmp_path / "r.jsonl", records)), limit=3)
    assert [c[1]["content"] for c in corpus.items] == ["a0", "a1", "a2"]
    with pytest.raises(ConfigError, match="limit must be a positive integer"):
        load_conversations(str(tmp_path / "r.jsonl"), limit=0)


def test_text_object_becomes_a_text_corpus_of_many_documents(tmp_path):
    paragraphs = [f"Paragraph {i} " + "word " * 40 for i in range(30)]
    (tmp_path / "t.json").write_text(json.dumps({"text": "\n\n".join(paragraphs)}))
    corpus = load_conversations(str(tmp_path / "t.json"), text_chunk_chars=500)
    assert corpus.kind == "text" and all(isinstance(d, TextDocument) for d in corpus.items)
    assert len(corpus.items) > 5
    assert all(len(d.text) < 1500 for d in corpus.items)
    # Nothing is lost or reordered: the documents concatenate back to the paragraphs.
    assert "\n\n".join(d.text for d in corpus.items) == "\n\n".join(p.strip() for p in paragraphs)
    assert len(load_conversations(str(tmp_path / "t.json"), text_chunk_chars=500, limit=2).items) == 2


def test_split_text_cuts_paragraphs_without_blank_lines():
    text = "\n".join(f"line {i} " + "x" * 50 for i in range(200))  # one ~12k-char paragraph
    documents = split_text(text, chunk_chars=1000)
    assert len(documents) >= 10 and all(len(d) < 2000 for d in documents)
    assert "\n".join(documents) == text


def test_unknown_record_shape_names_keys_and_supported_shapes(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": "q", "completion": "a"}])
    with pytest.raises(ConfigError, match=r"unknown record shape: found keys \['completion', 'prompt'\].*messages.*"
                                          r"conversations.*chosen.*question.*answer.*text"):
        load_conversations(str(tmp_path / "q.jsonl"))


def test_question_answer_records_are_single_turn_chats(tmp_path):
    records = [{"question": " What is 2+3? ", "answer": "2+3=5\n#### 5", "extra": 1},
               {"question": "No answer text?", "answer": None}]
    corpus = load_conversations(str(write_jsonl(tmp_path / "qa.jsonl", records)))
    assert corpus.items == ([{"role": "user", "content": "What is 2+3?"},
                             {"role": "assistant", "content": "2+3=5\n#### 5"}],)
    assert corpus.dropped == 1


def _qa_file(tmp_path, name, n):
    return str(write_jsonl(tmp_path / name, [{"question": f"{name} q{i}", "answer": f"{name} a{i}"} for i in range(n)]))


def test_a_mixture_interleaves_its_sources_and_reloads_from_its_manifest(tmp_path):
    from infra.data_manifest import build_manifest, conversations_from_manifest
    from infra.samples import Sample

    a, b = _qa_file(tmp_path, "a.jsonl", 5), _qa_file(tmp_path, "b.jsonl", 2)
    corpus = load_conversations([a, b])
    questions = [c[0]["content"] for c in corpus.items]
    # One from each in turn; the shorter source runs out and the longer one continues alone.
    assert questions == ["a.jsonl q0", "b.jsonl q0", "a.jsonl q1", "b.jsonl q1", "a.jsonl q2", "a.jsonl q3",
                         "a.jsonl q4"]
    assert corpus.kind == "chat" and corpus.source == [a, b] and corpus.name == f"{a} + {b}"
    # A limit keeps the mixture's first items: each source about equally, and a prefix of any larger limit.
    limited = load_conversations([a, b], limit=3)
    assert limited.items == corpus.items[:3]
    # The manifest records the list, and the same split comes back from it.
    ids = torch.tensor([1, 2])
    train = [Sample(prefix_ids=ids, continuation_ids=ids, conversation=i) for i in (0, 1, 2)]
    val = [Sample(prefix_ids=ids, continuation_ids=ids, conversation=4)]
    manifest = build_manifest(corpus, train, val)
    assert manifest["source"] == [a, b]
    rebuilt = conversations_from_manifest(manifest)
    assert rebuilt["train"] == list(corpus.items[:3]) and rebuilt["val"] == [corpus.items[4]]


def test_bad_mixtures_are_config_errors_naming_the_problem(tmp_path):
    from infra.conversations import check_source

    a = _qa_file(tmp_path, "a.jsonl", 2)
    (tmp_path / "t.json").write_text(json.dumps({"text": "some plain text " * 20}))
    with pytest.raises(ConfigError, match=r"all chat or all plain text: .*a.jsonl' is chat, .*t.json' is text"):
        load_conversations([a, str(tmp_path / "t.json")])
    with pytest.raises(ConfigError, match="names .*a.jsonl' more than once"):
        load_conversations([a, a])
    with pytest.raises(ConfigError, match="at least two sources"):
        load_conversations([a])
    # Every bad source of a mixture at once, before anything is read.
    with pytest.raises(ConfigError, match=r"'missing1.jsonl' is not .*; conversation source 'missing2.jsonl' is not"):
        check_source([a, "missing1.jsonl", "missing2.jsonl"])
    check_source([a, "embedded:10"])


def test_fit_config_takes_a_mixture_as_a_list(tmp_path):
    from infra.config import FitConfig, load_config

    assert load_config(FitConfig, None, {"source": "s", "target": "t", "data": ["embedded:10"]}).data == "embedded:10"
    both = ["embedded:10", "x.jsonl"]
    assert load_config(FitConfig, None, {"source": "s", "target": "t", "data": both}).data == both
    with pytest.raises(ConfigError, match="more than once"):
        load_config(FitConfig, None, {"source": "s", "target": "t", "data": ["x.jsonl", "x.jsonl"]})


def test_mixed_record_shapes_are_rejected(tmp_path):
    write_jsonl(tmp_path / "mix.jsonl", [HH_RECORDS[0], {"text": "t"}])
    with pytest.raises(ConfigError, match="record 1 has no 'chosen' field"):
        load_conversations(str(tmp_path / "mix.jsonl"))


def test_missing_file_says_where_it_looked(tmp_path):
    missing = tmp_path / "nope" / "chat.jsonl"
    with pytest.raises(ConfigError, match=f"not found: looked for '{missing}'"):
        load_conversations(str(missing))


def test_invalid_json_line_is_reported(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_conversations(str(tmp_path / "bad.jsonl"))


def test_empty_sources_are_config_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty dataset"):
        load_conversations(str(tmp_path / "empty.jsonl"))
    write_jsonl(tmp_path / "drop.jsonl", [HH_RECORDS[2]])
    with pytest.raises(ConfigError, match="empty dataset.*1 conversations dropped"):
        load_conversations(str(tmp_path / "drop.jsonl"))


def test_unknown_source_is_config_error():
    with pytest.raises(ConfigError, match="unknown conversation source 'not a source'"):
        load_conversations("not a source")


@pytest.mark.parametrize("source", ["someorg/some-chat-data", "someorg/some-chat-data:test"])
def test_offline_uncached_hub_dataset_explains_what_to_do(source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    # The real library must not even be asked: a stub that fails loudly proves it.
    stub = types.SimpleNamespace(load_dataset=lambda *a, **k: pytest.fail("load_dataset called offline"))
    monkeypatch.setitem(sys.modules, "datasets", stub)
    with pytest.raises(ConfigError, match=r"'someorg/some-chat-data' is not in the local cache.*HF_DATASETS_OFFLINE=0"
                                          r".*local \.jsonl"):
        load_conversations(source)


def test_cached_hub_dataset_loads_through_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    (tmp_path / "hf" / "hub" / "datasets--org--chat").mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    calls = []

    def load_dataset(repo, split=None):
        calls.append((repo, split))
        return rows if split else {"train_sft": rows, "test_sft": []}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_conversations("org/chat:train_sft").items == (rows[0]["messages"],)
    with pytest.raises(ConfigError, match=r"splits \['train_sft', 'test_sft'\].*'org/chat:train_sft'"):
        load_conversations("org/chat")
    assert calls == [("org/chat", "train_sft"), ("org/chat", None)]


def test_real_hh_rlhf_file(shared_data):
    corpus = load_conversations(str(shared_data / "chat" / "hh-rlhf-harmless-base.test.jsonl.gz"), limit=50)
    assert corpus.kind == "chat" and len(corpus.items) == 50
    for conversation in corpus.items:
        assert conversation[0]["role"] == "user"
        roles = [m["role"] for m in conversation]
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating after merging
        assert any(m["role"] == "assistant" and m["content"] for m in conversation)
        # (A few answers quote "Human:" themselves; only the "\n\nSpeaker:" separators must be gone.)
        assert not any("\n\nHuman:" in m["content"] or "\n\nAssistant:" in m["content"] for m in conversation)


def test_real_chat_and_gsm8k_mixture(shared_data):
    hh, gsm8k = str(shared_data / "chat" / "hh-rlhf-harmless-base.test.jsonl.gz"), str(shared_data / "gsm8k" / "test.jsonl")
    corpus = load_conversations([hh, gsm8k], limit=40)
    assert len(corpus.items) == 40 and corpus.kind == "chat"
    # Every second item is a GSM8K problem: one user question, one answer ending in "#### <number>".
    for conversation in corpus.items[1::2]:
        assert [m["role"] for m in conversation] == ["user", "assistant"]
        assert conversation[1]["content"].split("####")[-1].strip().replace(",", "").lstrip("-").isdigit()


def test_real_paul_graham_essays_give_many_documents(shared_data):
    corpus = load_conversations(str(shared_data / "ruler" / "PaulGrahamEssays.json"))
    assert corpus.kind == "text" and len(corpus.items) > 200
    assert all(len(d.text) >= 1000 for d in corpus.items[:-1])
