"""Grounded multi-turn QA in the CoQA style: a passage and a run of questions about it, scored per turn by token
F1 and gold-in-answer (KV-Lingo App. D, Table 4).

Source: XQuAD (SQuAD v1.1 format; each paragraph with its questions becomes one conversation).
The first user turn carries the passage and the first question; later user turns carry one question each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.errors import require_file
from evals.metrics import gold_in_answer, token_f1
from translators.errors import ConfigError

XQUAD_HELP = ("Get XQuAD from the deepmind/xquad GitHub repository (https://github.com/deepmind/xquad, files "
              "xquad.<lang>.json) and pass the file's path.")
INSTRUCTION = "Answer the questions about the passage below briefly, in a few words."


@dataclass(frozen=True)
class QATurn:
    """One question with its acceptable answers (scores take the maximum over golds)."""

    question: str
    golds: tuple[str, ...]


@dataclass(frozen=True)
class QAConversation:
    """A passage and its questions in order."""

    id: str
    context: str
    turns: tuple[QATurn, ...]


def user_messages(conv: QAConversation) -> list[str]:
    """The user turns' texts: the first carries the instruction, the passage and question 1; later ones one
    question each. Returns len(conv.turns) strings."""
    first = f"{INSTRUCTION}\n\n{conv.context}\n\n{conv.turns[0].question}"
    return [first] + [t.question for t in conv.turns[1:]]


def chat_messages(conv: QAConversation, answers: Sequence[str]) -> list[dict[str, str]]:
    """Chat messages up to the user turn after the given answers: answers[i] is the assistant's reply to turn i.

    With k answers the list ends on user turn k (the one to answer next), so it is ready for a chat template
    with add_generation_prompt=True.

    Raises:
        ConfigError: as many or more answers than turns (there is no next question).
    """
    if len(answers) >= len(conv.turns):
        raise ConfigError(f"conversation {conv.id} has {len(conv.turns)} turns; got {len(answers)} answers, so "
                          "there is no next question")
    users = user_messages(conv)
    messages = []
    for i, answer in enumerate(answers):
        messages += [{"role": "user", "content": users[i]}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": users[len(answers)]})
    return messages


def score_turn(prediction: str, turn: QATurn) -> dict[str, float]:
    """{"f1": token F1, "gold_in_answer": 0/1} of one answer against the turn's golds (max over golds)."""
    return {"f1": token_f1(prediction, turn.golds), "gold_in_answer": gold_in_answer(prediction, turn.golds)}


# ---------------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------------


def _check_limits(limit: int | None, max_turns: int | None) -> None:
    """Raises ConfigError for a limit or max_turns below 1."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1 (or None for all), got {limit}")
    if max_turns is not None and max_turns < 1:
        raise ConfigError(f"max_turns must be >= 1 (or None for all), got {max_turns}")


def _read_json(path: str | Path, what: str, how_to_get: str) -> dict[str, Any]:
    """Parse a JSON file with a top-level "data" list.

    Raises:
        DataNotFoundError: the file is missing.
        ConfigError: not JSON, or no "data" list.
    """
    path = require_file(path, what, how_to_get)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}). {how_to_get}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ConfigError(f"{path} has no top-level \"data\" list: not a {what} file. {how_to_get}")
    return doc


def _unique(texts: Sequence[str]) -> tuple[str, ...]:
    """Non-empty stripped strings, duplicates removed, order kept."""
    return tuple(dict.fromkeys(t.strip() for t in texts if t and t.strip()))


def load_xquad(path: str | Path, limit: int | None = None, max_turns: int | None = None) -> list[QAConversation]:
    """XQuAD (SQuAD v1.1 format) as conversations, one per paragraph, questions in file order.

    limit: at most this many conversations (file order); max_turns: at most this many questions each.
    Conversation ids are "<title>/<paragraph index>" (the index counts paragraphs across the whole file).
    Paragraphs without questions, and questions without answers, are skipped.

    Raises:
        DataNotFoundError: the file is missing (says where it looked and how to get XQuAD).
        ConfigError: the file is not SQuAD-format JSON, or limit/max_turns < 1.
    """
    _check_limits(limit, max_turns)
    doc = _read_json(path, "XQuAD file", XQUAD_HELP)
    convs: list[QAConversation] = []
    index = 0
    try:
        for article in doc["data"]:
            for paragraph in article["paragraphs"]:
                turns = [QATurn(qa["question"].strip(), _unique([a["text"] for a in qa["answers"]]))
                         for qa in paragraph["qas"]]
                turns = [t for t in turns if t.golds][:max_turns]
                if turns:
                    convs.append(QAConversation(f"{article.get('title', 'article')}/{index}",
                                                paragraph["context"], tuple(turns)))
                index += 1
                if limit is not None and len(convs) >= limit:
                    return convs
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path} does not follow the SQuAD v1.1 layout (missing {exc}). {XQUAD_HELP}") from exc
    return convs
