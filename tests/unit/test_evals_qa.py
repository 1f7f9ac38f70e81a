import json

import pytest

from evals.errors import DataNotFoundError
from evals.qa import INSTRUCTION, QAConversation, QATurn, chat_messages, load_xquad, score_turn, user_messages
from translators.errors import ConfigError


def test_xquad_counts_and_order(shared_data):
    path = shared_data / "xquad" / "xquad.en.json"
    convs = load_xquad(path)
    assert len(convs) == 240
    assert sum(len(c.turns) for c in convs) == 1190
    raw = json.loads(path.read_text())["data"][0]["paragraphs"][0]
    first = convs[0]
    assert first.context == raw["context"] and first.id == "Super_Bowl_50/0"
    assert [t.question for t in first.turns] == [qa["question"].strip() for qa in raw["qas"]]
    assert [t.golds for t in first.turns] == [(qa["answers"][0]["text"],) for qa in raw["qas"]]
    assert len({c.id for c in convs}) == 240


def test_xquad_limit_and_max_turns(shared_data):
    convs = load_xquad(shared_data / "xquad" / "xquad.en.json", limit=7, max_turns=2)
    assert len(convs) == 7 and all(1 <= len(c.turns) <= 2 for c in convs)
    full = load_xquad(shared_data / "xquad" / "xquad.en.json", limit=7)
    assert [c.turns[:2] for c in full] == [c.turns for c in convs]


def test_missing_xquad_file_says_where_and_how(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_xquad(tmp_path / "xquad.en.json")
    assert str(tmp_path / "xquad.en.json") in str(err.value) and "deepmind/xquad" in str(err.value)


def test_malformed_files_are_config_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_xquad(bad)
    no_context = {"qas": [{"question": "q", "answers": [{"text": "a"}]}]}
    bad.write_text(json.dumps({"data": [{"paragraphs": [no_context]}]}))
    with pytest.raises(ConfigError, match="SQuAD"):
        load_xquad(bad)
    with pytest.raises(ConfigError, match="max_turns"):
        load_xquad(bad, max_turns=0)


def test_messages_carry_the_passage_in_the_first_turn_only():
    conv = QAConversation("c", "Cotton is a white kitten.", (QATurn("What color?", ("white",)),
                                                             QATurn("What animal?", ("kitten",))))
    users = user_messages(conv)
    assert users[0] == f"{INSTRUCTION}\n\nCotton is a white kitten.\n\nWhat color?"
    assert users[1] == "What animal?"
    assert chat_messages(conv, []) == [{"role": "user", "content": users[0]}]
    assert [m["role"] for m in chat_messages(conv, ["White."])] == ["user", "assistant", "user"]
    assert chat_messages(conv, ["White."])[-1]["content"] == "What animal?"
    with pytest.raises(ConfigError, match="no next question"):
        chat_messages(conv, ["White.", "A kitten."])


def test_turn_scores_on_hand_examples():
    turn = QATurn("Where did she live?", ("in a barn", "above the barn"))
    # "She lived in the barn." -> [she, lived, in, barn] vs [in, barn]: P = 2/4, R = 1, F1 = 2/3.
    assert score_turn("She lived in the barn.", turn) == {"f1": pytest.approx(2 / 3), "gold_in_answer": 1.0}
    # vs "above the barn" -> [above, barn]: overlap 1 of 2, P = R = 1/2; max over golds is "in a barn" (F1 1).
    assert score_turn("above barn", turn)["f1"] == 1.0
    assert score_turn("On a farm.", turn) == {"f1": 0.0, "gold_in_answer": 0.0}
