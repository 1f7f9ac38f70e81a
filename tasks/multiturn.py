"""`kvlingo bench multiturn`: alternating hand-offs between two models over many turns (paper §4.7, App. Q).

Each conversation (held-out, :func:`infra.synthetic_chat.handoff_conversations`) states two or three topics up
front, then asks one question per turn while the holder alternates A, B, A, B, …; every answer is scored (gold
answer in its first line). The same conversations are run in each mode: `reprefill` (each model reads what it
lacks itself: the reference), `segment` (only the span written since a model last held the conversation is
translated) and `naive` (the incoming model's line is a translation of the outgoing model's whole line, so
translated content gets translated again).

Pairs whose models tokenize differently run the same conversations as messages
(`translators.cross_conversation.CrossConversation`): each model renders the history in its own format and keeps
its own cache line over its rendering; translated content is aligned character by character onto the receiver's
tokens and the receiver prefills its own turn headers. A message whose two tokenizations cannot be aligned is read
by the receiver itself (counted in `messages_read_natively`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.rundirs import latest_fit_dir
from infra.synthetic_chat import MAX_HANDOFF_TURNS, handoff_conversations
from translators.errors import ConfigError
from translators.layout import is_hybrid

MODES = ("reprefill", "segment", "naive")


def _block(tokenizer, messages: list[dict], *, generation_prompt: bool, after_turn: bool) -> list[int]:
    """Token ids of ``messages`` (plus the assistant header when ``generation_prompt``), by `infra.chat`.

    ``after_turn``: the block follows a generated answer, which ends with its stop token (kept in the history)
    before the format's newline, so the newline is written here.
    """
    from infra.chat import render_chat

    rendered = ("\n" if after_turn else "") + render_chat(tokenizer, messages, generation_prompt=generation_prompt)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def run_multiturn(
    model_a: str,
    model_b: str,
    *,
    stage: str = "distilled",
    fit_dir_ab: Path | None = None,
    fit_dir_ba: Path | None = None,
    translator_ab: str | None = None,
    translator_ba: str | None = None,
    n_conversations: int = 8,
    turns: int = 8,
    max_new_tokens: int = 12,
    seed: int = 7,
) -> dict[str, Any]:
    """Per mode and turn: recall accuracy over the conversations, plus translation counters.

    Each direction's translator is `translator_ab`/`translator_ba` (a `registry.translator_ref` reference:
    PATH, models:/NAME@ALIAS or identity) when given, else the `stage` artifact of `fit_dir_ab`/`fit_dir_ba`
    (default: the newest fit of that direction).

    Raises:
        ConfigError: turns outside 2..MAX_HANDOFF_TURNS, unknown stage, a malformed reference, a reference and a
            fit directory for one direction, a missing translator artifact (says which fit to run).
        PairMismatchError: an artifact fitted for another pair (another tokenizer included), or the identity between
            models whose caches differ.
    """
    from infra.pairs import same_tokenizer
    from infra.zoo import load_model
    from registry.translator_ref import load_translator_ref
    from translators.stage1 import Side

    if not 2 <= turns <= MAX_HANDOFF_TURNS or n_conversations < 1:
        raise ConfigError(f"a hand-off needs 2 to {MAX_HANDOFF_TURNS} turns and at least 1 conversation, "
                          f"got turns={turns}, conversations={n_conversations}")
    if stage not in ("closed_form", "distilled"):
        raise ConfigError(f"unknown stage {stage!r}: closed_form or distilled")
    fit_dirs = {("A", "B"): fit_dir_ab, ("B", "A"): fit_dir_ba}
    refs = {("A", "B"): _given_ref(translator_ab, fit_dir_ab, "ab"), ("B", "A"): _given_ref(translator_ba, fit_dir_ba, "ba")}
    loaded = {"A": load_model(model_a), "B": load_model(model_b)}
    a, b = loaded["A"], loaded["B"]
    cross = not same_tokenizer(a, b)
    for (src, tgt), ref in refs.items():
        if ref is None:
            refs[(src, tgt)] = _fit_ref(fit_dirs[(src, tgt)], stage, loaded[src].name, loaded[tgt].name)
    hybrid = is_hybrid(a.layout) or is_hybrid(b.layout)
    translators = {(src, tgt): load_translator_ref(ref, loaded[src], loaded[tgt]) for (src, tgt), ref in refs.items()}
    sides = {"A": Side(a.model, a.layout), "B": Side(b.model, b.layout)}
    if cross and hybrid:
        raise ConfigError(f"{a.name} and {b.name} tokenize differently: hybrid hand-offs need one tokenizer")
    dialogue = (_CrossDialogue(loaded, sides, translators, max_new_tokens) if cross
                else _SharedDialogue(b.tokenizer, sides, translators, max_new_tokens, hybrid=hybrid))
    conversations = handoff_conversations(n_conversations, turns, seed)
    result: dict[str, Any] = {"model_a": a.name, "model_b": b.name, "stage": stage, "turns": turns,
                              "n_conversations": n_conversations, "cross_tokenizer": cross, "hybrid": hybrid,
                              "translators": {"ab": refs[("A", "B")].text, "ba": refs[("B", "A")].text}, "modes": {}}
    for mode in MODES:
        hits = [[0.0] * n_conversations for _ in range(turns)]
        max_count, native_reads = 0, 0
        for c, item in enumerate(conversations):
            conv = dialogue.start(mode, item.opening)
            for t, (question, gold) in enumerate(item.questions):
                holder = "A" if t % 2 == 0 else "B"
                if conv.holder != holder:
                    conv.switch_to(holder)
                answer = dialogue.ask(conv, question, t)
                hits[t][c] = float(gold.lower() in answer.strip().split("\n")[0].lower())
            max_count = max(max_count, conv.max_translation_count())
            native_reads += len(getattr(conv, "fallbacks", ()))
        result["modes"][mode] = {
            "per_turn": [sum(h) / n_conversations for h in hits],
            "mean": sum(sum(h) for h in hits) / (turns * n_conversations),
            "max_times_a_span_was_translated": max_count,
        }
        if cross:
            result["modes"][mode]["messages_read_natively"] = native_reads
    return result


class _SharedDialogue:
    """Hand-offs over one shared token history (both models use one tokenizer)."""

    def __init__(self, tokenizer, sides, translators, max_new_tokens: int, *, hybrid: bool = False):
        from infra.chat import stop_ids
        from translators.generation import GenerationSettings

        self.tokenizer, self.sides, self.translators, self.hybrid = tokenizer, sides, translators, hybrid
        self.settings = GenerationSettings(max_new_tokens=max_new_tokens, stop_ids=stop_ids(tokenizer))

    def start(self, mode: str, opening: list[dict]):
        """A conversation in `mode` held by A, its opening appended (a hybrid pair: `HybridConversation`)."""
        from translators.conversation import Conversation
        from translators.hybrid_conversation import HybridConversation

        kind = HybridConversation if self.hybrid else Conversation
        conv = kind(self.sides, holder="A", translators=self.translators, mode=mode, tokenizer=self.tokenizer)
        conv.append(_block(self.tokenizer, opening, generation_prompt=False, after_turn=False))
        return conv

    def ask(self, conv, question: str, turn: int) -> str:
        """The holder's answer text to `question` (turn index `turn`, 0-based)."""
        conv.append(_block(self.tokenizer, [{"role": "user", "content": question}], generation_prompt=True,
                           after_turn=turn > 0))
        return conv.generate(self.settings).text or ""


class _CrossDialogue:
    """Hand-offs over a message history each model renders in its own format (different tokenizers)."""

    def __init__(self, loaded, sides, translators, max_new_tokens: int):
        from infra.chat import stop_ids
        from infra.cross_samples import model_format
        from translators.generation import GenerationSettings

        self.sides, self.translators = sides, translators
        self.formats = {name: model_format(m.tokenizer) for name, m in loaded.items()}
        self.settings = {name: GenerationSettings(max_new_tokens=max_new_tokens, stop_ids=stop_ids(m.tokenizer))
                         for name, m in loaded.items()}

    def start(self, mode: str, opening: list[dict]):
        """A conversation in `mode` held by A, its opening appended (messages it reads when it first answers)."""
        from translators.cross_conversation import CrossConversation

        conv = CrossConversation(self.sides, self.formats, holder="A", translators=self.translators, mode=mode,
                                 unaligned="prefill")
        conv.append(opening)
        return conv

    def ask(self, conv, question: str, turn: int) -> str:
        """The holder's answer text to `question`."""
        conv.append([{"role": "user", "content": question}])
        return conv.generate(self.settings[conv.holder]).text or ""


def _given_ref(text: str | None, fit_dir: Path | None, direction: str):
    """The parsed `--translator-<direction>` reference, or None when not given.

    Raises:
        ConfigError: a malformed reference, or one given beside `--fit-dir-<direction>`.
    """
    from registry.translator_ref import parse_translator_ref

    if text is None:
        return None
    if fit_dir is not None:
        raise ConfigError(f"give --translator-{direction} or --fit-dir-{direction}, not both")
    return parse_translator_ref(text)


def _fit_ref(fit_dir: Path | None, stage: str, source: str, target: str):
    """The reference to the `stage` artifact of a fit directory (default: the newest fit of source → target).

    Raises:
        ConfigError: no such artifact (says which fit to run).
    """
    from registry.translator_ref import TranslatorRef

    path = Path(fit_dir or latest_fit_dir(source, target)) / stage
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"no {stage} translator at {path}: run `kvlingo fit {source} {target}` "
                          "(or pass its fit directory, or a translator reference)")
    return TranslatorRef("path", str(path), path)
