"""`kvlingo bench multiturn`: alternating hand-offs between two models over many turns (paper §4.7, App. Q).

Each conversation (held-out, :func:`infra.synthetic_chat.handoff_conversations`) states two or three topics up
front, then asks one question per turn while the holder alternates A, B, A, B, …; every answer is scored (gold
answer in its first line). The same conversations are run in each mode: `reprefill` (each model reads what it
lacks itself: the reference), `segment` (only the span written since a model last held the conversation is
translated) and `naive` (the incoming model's line is a translation of the outgoing model's whole line, so
translated content gets translated again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.rundirs import latest_fit_dir
from infra.synthetic_chat import MAX_HANDOFF_TURNS, handoff_conversations
from translators.errors import ConfigError

MODES = ("reprefill", "segment", "naive")


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool, after_turn: bool) -> list[int]:
    """Token ids of ``messages`` (plus the assistant header when ``generation_prompt``).

    ``after_turn``: the block follows a generated answer, which stops at the end-of-turn token
    before the template's trailing newline, so the newline is written here.
    """
    from infra.samples import has_chat_template

    if has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    else:
        rendered = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        rendered += "Assistant:" if generation_prompt else ""
    rendered = ("\n" if after_turn else "") + rendered
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def run_multiturn(
    model_a: str,
    model_b: str,
    *,
    stage: str = "distilled",
    fit_dir_ab: Path | None = None,
    fit_dir_ba: Path | None = None,
    n_conversations: int = 8,
    turns: int = 8,
    max_new_tokens: int = 12,
    seed: int = 7,
) -> dict[str, Any]:
    """Per mode and turn: recall accuracy over the conversations, plus translation counters.

    Raises:
        ConfigError: turns outside 2..MAX_HANDOFF_TURNS, a missing translator artifact (says which fit to run), unknown stage.
        PairMismatchError: an artifact fitted for another pair.
    """
    from infra.pairs import check_same_tokenizer, load_for_pair
    from infra.zoo import load_model
    from translators.conversation import Conversation
    from translators.generation import GenerationSettings
    from translators.stage1 import Side

    if not 2 <= turns <= MAX_HANDOFF_TURNS or n_conversations < 1:
        raise ConfigError(f"a hand-off needs 2 to {MAX_HANDOFF_TURNS} turns and at least 1 conversation, "
                          f"got turns={turns}, conversations={n_conversations}")
    if stage not in ("closed_form", "distilled"):
        raise ConfigError(f"unknown stage {stage!r}: closed_form or distilled")
    a, b = load_model(model_a), load_model(model_b)
    check_same_tokenizer(a, b)
    dirs = {
        ("A", "B"): Path(fit_dir_ab or latest_fit_dir(a.name, b.name)) / stage,
        ("B", "A"): Path(fit_dir_ba or latest_fit_dir(b.name, a.name)) / stage,
    }
    for (src, tgt), path in dirs.items():
        if not (path / "manifest.json").is_file():
            names = {"A": a.name, "B": b.name}
            raise ConfigError(f"no {stage} translator at {path}: run `kvlingo fit {names[src]} {names[tgt]}` "
                              "(or pass its fit directory)")
    translators = {("A", "B"): load_for_pair(dirs[("A", "B")], a, b), ("B", "A"): load_for_pair(dirs[("B", "A")], b, a)}
    sides = {"A": Side(a.model, a.layout), "B": Side(b.model, b.layout)}
    tokenizer = b.tokenizer
    stop = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    settings = GenerationSettings(max_new_tokens=max_new_tokens, stop_ids=tuple(sorted(stop)))
    conversations = handoff_conversations(n_conversations, turns, seed)
    result: dict[str, Any] = {"model_a": a.name, "model_b": b.name, "stage": stage, "turns": turns,
                              "n_conversations": n_conversations, "modes": {}}
    for mode in MODES:
        hits = [[0.0] * n_conversations for _ in range(turns)]
        max_count = 0
        for c, item in enumerate(conversations):
            conv = Conversation(sides, holder="A", translators=translators, mode=mode, tokenizer=tokenizer)
            conv.append(_render(tokenizer, item.opening, generation_prompt=False, after_turn=False))
            for t, (question, gold) in enumerate(item.questions):
                holder = "A" if t % 2 == 0 else "B"
                if conv.holder != holder:
                    conv.switch_to(holder)
                conv.append(_render(tokenizer, [{"role": "user", "content": question}], generation_prompt=True,
                                    after_turn=t > 0))
                answer = conv.generate(settings).text or ""
                hits[t][c] = float(gold.lower() in answer.strip().split("\n")[0].lower())
            max_count = max(max_count, conv.max_translation_count())
        result["modes"][mode] = {
            "per_turn": [sum(h) / n_conversations for h in hits],
            "mean": sum(sum(h) for h in hits) / (turns * n_conversations),
            "max_times_a_span_was_translated": max_count,
        }
    return result
