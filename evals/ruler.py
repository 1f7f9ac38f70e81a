"""RULER single-needle retrieval (NIAH) items at a requested context length in tokens of a given tokenizer.

A needle "One of the special magic numbers for {key} is: {value}." is placed at a depth fraction inside a
haystack, which is either RULER's noise haystack (a fixed run of short sentences, repeated) or the Paul Graham
essay haystack (a local JSON file {"text": ...}, as RULER's data script writes it). The model is asked for the
number; recall is 1 when the gold value appears in its answer (RULER's string match).

`RulerItem.length` is the requested length; the context (haystack + needle) is the longest that does not exceed
it, so its token count is at most `length` and short of it by less than one haystack unit (a noise sentence or
an essay word). The instruction, question and chat template come on top.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.errors import require_file
from translators.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.")
HAYSTACKS = ("noise", "essay")

ESSAY_HELP = ("RULER's essay haystack is the Paul Graham essays concatenated into one JSON object {\"text\": ...}; "
              "NVIDIA/RULER's scripts/data/synthetic/json/download_paulgraham_essay.py downloads and writes it "
              "(PaulGrahamEssays.json). Pass its path as essay_path, or use haystack='noise'.")

# Keys are "adjective-noun" pairs, like RULER's word keys; small fixed lists keep items reproducible offline.
_ADJECTIVES = ("ancient", "brave", "calm", "crimson", "eager", "faint", "gentle", "hollow", "icy", "jolly",
               "keen", "lively", "mellow", "nimble", "odd", "plain", "quiet", "rapid", "silent", "tidy",
               "upbeat", "vivid", "witty", "young", "zesty", "amber", "bold", "cozy", "dusty", "lucky")
_NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
          "umbrella", "valley", "window", "yacht", "zephyr", "bridge", "canyon", "forest", "marble", "violin")


@dataclass(frozen=True)
class RulerItem:
    """One needle-retrieval item.

    context: haystack text with the needle inserted; question, answer_prefix: what to ask and how the answer
    starts; gold: the needle's value (a 7-digit number as a string); length: the requested context length in
    tokens; depth: where the needle sits, 0.0 = first sentence, 1.0 = after the last; haystack: "noise"/"essay".
    """

    context: str
    question: str
    answer_prefix: str
    gold: str
    length: int
    depth: float
    key: str
    haystack: str

    def prompt(self) -> str:
        """The user message in RULER's layout: instruction, context, question."""
        return f"{INSTRUCTION}\n{self.context}\n{self.question}"


def score_ruler(prediction: str, item: RulerItem) -> float:
    """Recall: 1.0 if the gold value occurs in the generated answer (case-insensitive), else 0.0."""
    return float(item.gold.lower() in prediction.lower())


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of `text` without special tokens.

    Accepts a transformers tokenizer (encode -> list of ids) or a `tokenizers.Tokenizer` (encode -> Encoding).
    """
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return len(encoded.ids) if hasattr(encoded, "ids") else len(encoded)


# ---------------------------------------------------------------------------------------------------------------
# Haystacks: a haystack is built from its first k units; the needle goes between sentences.
# ---------------------------------------------------------------------------------------------------------------


def noise_sentences() -> list[str]:
    """The noise haystack's repeating sentences, one per unit (finer units give a closer length fit)."""
    return [s.strip() for s in re.findall(r"[^.]+\.", NOISE)]


def load_essay_words(path: str | Path) -> list[str]:
    """Whitespace-separated words of the essay haystack file {"text": ...}.

    Raises:
        DataNotFoundError: the file does not exist (the message says where it looked and how to get it).
        ConfigError: the file is not a JSON object with a non-empty string "text".
    """
    path = require_file(path, "RULER essay haystack", ESSAY_HELP)
    try:
        text = json.loads(path.read_text(encoding="utf-8")).get("text")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"{path} is not a JSON object {{\"text\": ...}}: {exc}") from exc
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{path} has no non-empty string under \"text\". {ESSAY_HELP}")
    return text.split()


def _noise_units(k: int, sentences: Sequence[str]) -> list[str]:
    """The first k noise sentences (cycling): k sentences."""
    return [sentences[i % len(sentences)] for i in range(k)]


def _essay_units(k: int, words: Sequence[str]) -> list[str]:
    """The first k essay words re-split into sentences (after ., ! or ? followed by a space)."""
    return re.split(r"(?<=[.!?])\s+", " ".join(words[:k])) if k else []


def _insert_needle(sentences: list[str], needle: str, depth: float) -> str:
    """Join sentences with the needle inserted before sentence round(depth * n_sentences)."""
    at = round(depth * len(sentences))
    return " ".join([*sentences[:at], needle, *sentences[at:]])


def _largest_fitting(fits: Callable[[int], bool], upper: int, hint: int) -> int:
    """Largest k in [0, upper] with fits(k), assuming fits is monotone (True then False); starts near hint.

    Gallops from the hint (items at one length need almost the same k), then bisects. Returns -1 if not even
    fits(0).
    """
    hint = min(max(hint, 0), upper)
    step = 1
    if fits(hint):
        lo, hi = hint, None  # fits(lo) is True
        while hi is None:
            probe = min(lo + step, upper)
            if probe == lo:
                return lo
            if fits(probe):
                lo, step = probe, step * 2
            else:
                hi = probe
    else:
        hi, lo = hint, None  # fits(hi) is False
        while lo is None:
            probe = max(hi - step, 0)
            if fits(probe):
                lo = probe
            elif probe == 0:
                return -1
            else:
                hi, step = probe, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------------------------------------------


def _check_args(lengths: Sequence[int], n_per_length: int, haystack: str,
                depths: Sequence[float] | None) -> None:
    """Raises ConfigError for an unknown haystack, non-positive lengths/counts or depths outside [0, 1]."""
    if haystack not in HAYSTACKS:
        raise ConfigError(f"unknown RULER haystack {haystack!r}: choose one of {HAYSTACKS}")
    if not lengths or any(int(n) < 1 for n in lengths):
        raise ConfigError(f"lengths must be one or more positive token counts, got {list(lengths)}")
    if n_per_length < 1:
        raise ConfigError(f"n_per_length must be >= 1, got {n_per_length}")
    if depths is not None and (len(depths) != n_per_length or any(not 0.0 <= d <= 1.0 for d in depths)):
        raise ConfigError(f"depths must be {n_per_length} fractions in [0, 1] (one per item), got {list(depths)}")


def _keys(rng: random.Random, n: int) -> list[str]:
    """n distinct "adjective-noun" keys (a numeric suffix once the 900 pairs run out)."""
    pairs = [f"{a}-{b}" for a in _ADJECTIVES for b in _NOUNS]
    rng.shuffle(pairs)
    return [pairs[i % len(pairs)] + (f"-{i // len(pairs)}" if i >= len(pairs) else "") for i in range(n)]


def default_depths(n: int) -> list[float]:
    """n depths spread evenly over [0, 1] (both ends included), so every length probes the whole context."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def build_ruler_items(
    tokenizer: Any,
    lengths: Sequence[int],
    n_per_length: int,
    *,
    haystack: str = "noise",
    essay_path: str | Path | None = None,
    depths: Sequence[float] | None = None,
    seed: int = 0,
) -> list[RulerItem]:
    """Needle-retrieval items, n_per_length at each requested context length (tokens of `tokenizer`).

    Deterministic given the seed: keys and values come from random.Random(seed); depths default to an even
    spread over [0, 1]. Keys are distinct within one length.

    Raises:
        ConfigError: bad arguments, a length too short to hold the needle, or a haystack too short for a length.
        DataNotFoundError: haystack="essay" and the essay file is missing (or essay_path not given).
    """
    _check_args(lengths, n_per_length, haystack, depths)
    if haystack == "essay":
        if essay_path is None:
            raise ConfigError(f"haystack='essay' needs essay_path. {ESSAY_HELP}")
        words = load_essay_words(essay_path)
        units, upper = (lambda k: _essay_units(k, words)), len(words)
    else:
        sentences = noise_sentences()
        # Enough noise for any length: every sentence is at least one token.
        units, upper = (lambda k: _noise_units(k, sentences)), None
    rng = random.Random(seed)
    depths = list(depths) if depths is not None else default_depths(n_per_length)
    items = []
    for length in lengths:
        hint = 0
        for key, depth in zip(_keys(rng, n_per_length), depths):
            value = str(rng.randint(1_000_000, 9_999_999))
            item, hint = _build_item(tokenizer, int(length), depth, key, value, units,
                                     upper if upper is not None else int(length), hint, haystack)
            items.append(item)
    return items


def _build_item(tokenizer: Any, length: int, depth: float, key: str, value: str,
                units: Callable[[int], list[str]], upper: int, hint: int,
                haystack: str) -> tuple[RulerItem, int]:
    """One item whose context is the longest haystack prefix (+ needle) within `length` tokens; also returns
    the unit count used (the next item's search hint).

    Raises:
        ConfigError: the needle alone exceeds `length`, or the haystack runs out before reaching it.
    """
    needle = NEEDLE.format(key=key, value=value)

    def context(k: int) -> str:
        return _insert_needle(units(k), needle, depth)

    k = _largest_fitting(lambda k: count_tokens(tokenizer, context(k)) <= length, upper, hint)
    if k < 0:
        raise ConfigError(f"RULER length {length} is shorter than the needle alone "
                          f"({count_tokens(tokenizer, needle)} tokens): ask for a longer context")
    if k == upper and upper > 0 and haystack == "essay":
        raise ConfigError(f"the essay haystack ({upper} words) is too short for {length} tokens: use a shorter "
                          f"length or haystack='noise'")
    item = RulerItem(context=context(k), question=QUESTION.format(key=key),
                     answer_prefix=ANSWER_PREFIX.format(key=key), gold=value, length=length, depth=depth,
                     key=key, haystack=haystack)
    return item, k
