"""Unit tests of the synthetic chat corpus: determinism, held-out disjointness, answerability."""

from __future__ import annotations

import pytest

from infra.synthetic_chat import (
    CODE_RANGE,
    HANDOFF_STREAM,
    HELDOUT_STREAM,
    MAX_HANDOFF_TURNS,
    KINDS,
    SMALL_TALK,
    TRAIN_STREAM,
    YEAR_RANGE,
    EvalItem,
    answer_chance,
    generate_conversations,
    handoff_conversations,
    item_seed,
    recall_items,
)


def test_same_seed_gives_identical_corpus():
    assert generate_conversations(50, seed=3) == generate_conversations(50, seed=3)
    assert recall_items(30, seed=3) == recall_items(30, seed=3)


def test_different_seeds_differ():
    assert generate_conversations(20, seed=0) != generate_conversations(20, seed=1)


def test_prefix_stability():
    # Each conversation depends only on its own item seed, so a longer corpus extends a shorter one.
    assert generate_conversations(40, seed=5)[:10] == generate_conversations(10, seed=5)


def test_conversation_shape():
    for messages in generate_conversations(200, seed=0):
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert 2 <= len(roles) // 2 <= 4
        assert all(isinstance(m["content"], str) and m["content"] for m in messages)


def test_train_and_heldout_item_seeds_are_disjoint():
    train = {item_seed(TRAIN_STREAM, s, i) for s in range(4) for i in range(500)}
    held_out = {item_seed(HELDOUT_STREAM, s, i) for s in range(4) for i in range(500)}
    handoff = {item_seed(HANDOFF_STREAM, s, i) for s in range(4) for i in range(500)}
    assert not train & held_out and not train & handoff and not held_out & handoff
    # Distinct (seed, index) pairs never collide within a stream either.
    assert len(train) == 4 * 500


def test_heldout_items_are_not_training_conversations():
    train = {repr(m[:-1]) for m in generate_conversations(2000, seed=0)}
    assert not any(repr(item.messages) in train for item in recall_items(200, seed=0))


def test_items_end_with_a_user_question_answerable_from_context():
    items = recall_items(150, seed=0)
    for item in items:
        assert isinstance(item, EvalItem)
        assert item.messages[-1]["role"] == "user"
        assert item.answer.endswith(".")
        value = item.answer.removesuffix(".")
        context = " ".join(m["content"] for m in item.messages[:-1])
        assert value in context, (item.kind, value, context)


def test_all_kinds_present_and_balanced():
    items = recall_items(60, seed=0)
    assert [item.kind for item in items].count("fact") == 20
    assert {item.kind for item in items} == set(KINDS)


def test_training_answers_come_from_context():
    small_talk = {said for said, _ in SMALL_TALK}
    for messages in generate_conversations(300, seed=1):
        for i, message in enumerate(messages):
            question = messages[i - 1]["content"]
            if message["role"] == "assistant" and question.endswith("?") and question not in small_talk:
                value = message["content"].removesuffix(".")
                earlier = " ".join(m["content"] for m in messages[: i - 1])
                assert value in earlier


def test_answer_chance_is_small_and_positive():
    for item in recall_items(60, seed=0):
        chance = answer_chance(item.answer)
        assert 0 < chance < 0.2
        code = int(item.answer.removesuffix(".")) if item.kind == "needle" else None
        # A code that is also a possible year counts with the (smaller) year pool: conservative.
        if code is not None and not YEAR_RANGE[0] <= code <= YEAR_RANGE[1]:
            assert chance == pytest.approx(1 / (CODE_RANGE[1] - CODE_RANGE[0] + 1))


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        generate_conversations(-1, seed=0)
    with pytest.raises(ValueError):
        item_seed(TRAIN_STREAM, -1, 0)


@pytest.mark.parametrize("turns", [2, 8, MAX_HANDOFF_TURNS])
def test_handoff_questions_are_distinct_and_answerable_from_the_opening(turns):
    conversations = handoff_conversations(60, turns, seed=7)
    assert conversations == handoff_conversations(60, turns, seed=7)
    for conversation in conversations:
        roles = [m["role"] for m in conversation.opening]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) // 2 <= 3
        assert len(conversation.questions) == turns == len(set(conversation.questions))
        stated = " ".join(m["content"] for m in conversation.opening if m["role"] == "user")
        for question, gold in conversation.questions:
            assert question.endswith("?") and gold in stated and not gold.endswith(".")


def test_handoff_turns_out_of_range_raise():
    for turns in (0, MAX_HANDOFF_TURNS + 1):
        with pytest.raises(ValueError, match=f"between 1 and {MAX_HANDOFF_TURNS}"):
            handoff_conversations(2, turns, seed=0)
