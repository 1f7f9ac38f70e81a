"""Prompt and answer functions the kvlingo task templates reference with `!function utils.<name>`.

lm-eval loads this file by path (next to the templates), so it imports nothing from the project.
Each function takes one dataset record (a dict) as the local JSON files store it.
"""

from __future__ import annotations

LETTERS = "ABCDEFGHIJ"


def mmlu_pro_text(doc: dict) -> str:
    """MMLU-Pro question with lettered options, ending in 'Answer:' (the letter is scored after it)."""
    subject = str(doc.get("category", "")).replace("_", " ")
    lines = [f"The following is a multiple choice question about {subject}.", "", doc["question"].strip()]
    lines += [f"{LETTERS[i]}. {option}" for i, option in enumerate(doc["options"])]
    lines.append("Answer:")
    return "\n".join(lines)


def mmlu_pro_choices(doc: dict) -> list[str]:
    """One letter per option (MMLU-Pro has up to ten)."""
    return list(LETTERS[: len(doc["options"])])


def _arc_parts(doc: dict) -> tuple[str, list[str], list[str]]:
    """(question, choice texts, choice labels) of an ARC record in either stored shape.

    AI2's original JSONL nests {question: {stem, choices: [{text, label}]}}; the hub dataset
    (allenai/ai2_arc) exported with `datasets` has {question: str, choices: {text: [...], label: [...]}}.
    """
    question = doc["question"]
    if isinstance(question, dict):
        choices = question["choices"]
        return question["stem"], [c["text"] for c in choices], [c["label"] for c in choices]
    return question, list(doc["choices"]["text"]), list(doc["choices"]["label"])


def arc_text(doc: dict) -> str:
    """'Question: <stem>', then 'Answer:' on the next line (the answer texts are scored after it)."""
    return f"Question: {_arc_parts(doc)[0].strip()}\nAnswer:"


def arc_choices(doc: dict) -> list[str]:
    """The answer texts of an ARC question, in label order as stored."""
    return _arc_parts(doc)[1]


def arc_target(doc: dict) -> int:
    """Index of the answer key among the labels (labels are A-E or 1-4 depending on the item)."""
    return _arc_parts(doc)[2].index(doc["answerKey"])


def gsm8k_target(doc: dict) -> str:
    """The final number of a GSM8K solution (after '#### '), thousands separators removed."""
    return doc["answer"].split("####")[-1].strip().replace(",", "")
