"""(prefix, continuation) training samples, as in App. C of the KV-Lingo paper.

A sample is a token prefix whose KV cache gets translated, plus the continuation the target model
then reads on top of the translated cache. For chat models the prefix is a conversation rendered with
the tokenizer's chat template up to the header of an assistant turn, and the continuation is that
turn's answer with its end-of-turn marker; for models without a chat template it is a random window
of plain text.

Sampling is deterministic: each conversation/document draws from its own RNG seeded by
``(seed, index)``, so a sample does not depend on the other items (appending items changes none).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infra.chat import flatten_conversation, has_chat_template, render_chat
from infra.conversations import Conversation, Corpus, TextDocument
from translators.errors import ConfigError, PrefixTooLongError

log = logging.getLogger(__name__)


# eq=False: comparing tensors elementwise inside a generated __eq__ would raise; compare fields explicitly.
@dataclass(frozen=True, eq=False)
class Sample:
    """One training sample.

    Attributes:
        prefix_ids: ``[n]`` int64, the rendered prefix ending at the assistant header (what gets
            translated), or the first part of a text window.
        continuation_ids: ``[m]`` int64, the assistant answer incl. its end-of-turn token(s), or the
            rest of the text window.
        conversation: index of the source conversation/document (for splitting).
    """

    prefix_ids: torch.Tensor
    continuation_ids: torch.Tensor
    conversation: int

    def fingerprint_bytes(self) -> bytes:
        """The token ids as bytes, for content hashes of the data a fit read."""
        return self.prefix_ids.numpy().tobytes() + b"|" + self.continuation_ids.numpy().tobytes()


# --- Shared helpers -----------------------------------------------------------------------------


def _rng(seed: int, index: int) -> random.Random:
    """The RNG of item ``index``: independent of the other items, fixed by ``(seed, index)``."""
    # String seeds are hashed with SHA-512 by `random`, so distinct (seed, index) pairs never collide.
    return random.Random(f"kvlingo-samples:{seed}:{index}")


def _check_count(name: str, value: Any) -> None:
    """Reject non-integers and values < 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_seed(seed: Any) -> None:
    """Seeds are non-negative integers (as everywhere in the platform)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")


def _ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without added special tokens (templates already place BOS where wanted)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _tensor(ids: Sequence[int]) -> torch.Tensor:
    """``[len(ids)]`` int64 tensor."""
    return torch.tensor(list(ids), dtype=torch.long)


def _report_skips(what: str, skipped: Counter, total: int) -> None:
    """Log how many items produced no sample, by reason."""
    if skipped:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        log.warning("%s: %d of %d items gave no sample (%s)", what, sum(skipped.values()), total, reasons)


# --- Chat samples -------------------------------------------------------------------------------


def chat_samples(conversations: Sequence[Conversation], tokenizer: Any, *, seed: int,
                 max_prefix_tokens: int = 1024, max_continuation_tokens: int = 256,
                 samples_per_conversation: int = 1) -> list[Sample]:
    """Samples cut at random assistant turns of chat conversations.

    For each conversation, up to ``samples_per_conversation`` distinct assistant turns ``t`` (with
    non-empty content and at least one message before them) are drawn. The prefix is
    ``messages[:t]`` rendered with ``add_generation_prompt=True`` and ``enable_thinking=False``, so
    that a template with an empty-reasoning placeholder (Qwen3's ``<think>\\n\\n</think>\\n\\n``)
    puts it at the end of the prefix; templates that do not know the flag ignore it. The
    continuation is turn ``t`` as the template renders it, end-of-turn marker included: the render
    of ``messages[:t + 1]`` minus the prefix text when it starts with it, otherwise (templates that
    move or drop reasoning blocks) the render from the answer's last occurrence to the end.

    Prefix and continuation are tokenized separately with ``add_special_tokens=False``. Caps keep
    the LAST ``max_prefix_tokens`` prefix tokens (the end is where the models switch) and the FIRST
    ``max_continuation_tokens`` continuation tokens.

    Args:
        conversations: chats of ``{"role", "content"}`` messages; the list index becomes
            :attr:`Sample.conversation`.
        tokenizer: a Hugging Face tokenizer with a chat template.
        seed: sampling seed.

    Returns:
        The samples, grouped by conversation in input order. Conversations that give none (no
        eligible turn, template error, answer not found in the render, empty continuation) are
        counted in a log warning.

    Raises:
        ConfigError: the tokenizer has no chat template, bad caps or counts, or no conversation gave
            a sample (the message quotes the first template error, if any).
    """
    if not has_chat_template(tokenizer):
        raise ConfigError(f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no "
                          f"chat template: use a plain-text source (a .jsonl/.json file of {{'text': ...}} records) "
                          f"or build_samples(), which flattens chats into text for such models")
    _check_seed(seed)
    for name, value in (("max_prefix_tokens", max_prefix_tokens), ("max_continuation_tokens", max_continuation_tokens),
                        ("samples_per_conversation", samples_per_conversation)):
        _check_count(name, value)
    samples: list[Sample] = []
    skipped: Counter = Counter()
    first_error: str | None = None
    for index, messages in enumerate(conversations):
        turns = _eligible_turns(messages)
        if not turns:
            skipped["without an assistant turn after context"] += 1
            continue
        rng = _rng(seed, index)
        for turn in sorted(rng.sample(turns, min(samples_per_conversation, len(turns)))):
            try:
                pair = _render_pair(tokenizer, messages, turn)
            except Exception as err:  # noqa: BLE001 -- templates raise anything (jinja, role checks)
                skipped["template errors"] += 1
                first_error = first_error or f"{type(err).__name__}: {err}"
                continue
            if pair is None:
                skipped["answers not found in the template's render"] += 1
                continue
            prefix_ids = _ids(tokenizer, pair[0])[-max_prefix_tokens:]
            continuation_ids = _ids(tokenizer, pair[1])[:max_continuation_tokens]
            if not continuation_ids or not prefix_ids:
                skipped["empty prefixes or continuations"] += 1
                continue
            samples.append(Sample(_tensor(prefix_ids), _tensor(continuation_ids), index))
    _report_skips("chat_samples", skipped, len(conversations))
    if not samples:
        raise ConfigError(f"empty dataset: none of {len(conversations)} conversations gave a chat sample"
                          + (f"; first chat-template error: {first_error}" if first_error else "")
                          + "; check that conversations alternate user/assistant turns with non-empty answers")
    return samples


def _eligible_turns(messages: Conversation) -> list[int]:
    """Indices of assistant turns with content that have at least one message before them."""
    return [t for t, m in enumerate(messages)
            if t >= 1 and m.get("role") == "assistant" and str(m.get("content", "")).strip()]


def _render_pair(tokenizer: Any, messages: Conversation, turn: int) -> tuple[str, str] | None:
    """(prefix text, continuation text) for assistant turn ``turn``; None if the answer is not found."""
    prefix = render_chat(tokenizer, messages[:turn], generation_prompt=True)
    full = render_chat(tokenizer, messages[: turn + 1], generation_prompt=False)
    if full.startswith(prefix):
        return prefix, full[len(prefix):]
    # The template renders the final answer differently from a generation prompt (e.g. Qwen3 moves or
    # strips reasoning); templates often trim the content, so search for the stripped answer.
    answer = str(messages[turn]["content"]).strip()
    start = full.rfind(answer)
    if start < 0:
        return None
    return prefix, full[start:]


# --- Text samples -------------------------------------------------------------------------------


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before text on its own (e.g. BOS for Llama), possibly none."""
    plain = _ids(tokenizer, "a")
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    # Only a pure prefix counts: trailing EOS and the like belong to the end of a sequence, not a window.
    for cut in range(len(with_special) - len(plain) + 1):
        if with_special[cut: cut + len(plain)] == plain:
            return with_special[:cut]
    return []


def text_samples(documents: Sequence[TextDocument | str], tokenizer: Any, *, seed: int, prefix_tokens: int = 256,
                 continuation_tokens: int = 64, samples_per_document: int = 1) -> list[Sample]:
    """Random windows of plain text: ``prefix_tokens`` tokens of prefix, then ``continuation_tokens``.

    If the tokenizer adds leading special tokens by itself (BOS), the prefix starts with them and
    holds ``prefix_tokens - len(leading)`` document tokens, so that models trained with a BOS see
    one; lengths are exact either way. Windows of one document are drawn independently and may
    overlap.

    Args:
        documents: texts; the list index becomes :attr:`Sample.conversation`.
        tokenizer: any Hugging Face tokenizer.
        seed: sampling seed.

    Returns:
        Samples with ``prefix_ids`` of shape ``[prefix_tokens]`` and ``continuation_ids`` of shape
        ``[continuation_tokens]``; documents too short for one window are counted in a log warning.

    Raises:
        ConfigError: bad lengths or counts, or no document long enough (the message gives the
            longest document's length).
    """
    _check_seed(seed)
    for name, value in (("prefix_tokens", prefix_tokens), ("continuation_tokens", continuation_tokens),
                        ("samples_per_document", samples_per_document)):
        _check_count(name, value)
    lead = _leading_special_ids(tokenizer)
    if len(lead) >= prefix_tokens:
        raise ConfigError(f"prefix_tokens={prefix_tokens} leaves no room for text after the tokenizer's "
                          f"{len(lead)} leading special tokens; use a larger prefix_tokens")
    body = prefix_tokens - len(lead)
    needed = body + continuation_tokens
    samples: list[Sample] = []
    too_short, longest = 0, 0
    for index, document in enumerate(documents):
        ids = _ids(tokenizer, document.text if isinstance(document, TextDocument) else str(document))
        longest = max(longest, len(ids))
        if len(ids) < needed:
            too_short += 1
            continue
        rng = _rng(seed, index)
        for _ in range(samples_per_document):
            start = rng.randint(0, len(ids) - needed)
            window = ids[start: start + needed]
            samples.append(Sample(_tensor(lead + window[:body]), _tensor(window[body:]), index))
    _report_skips("text_samples", Counter({"documents shorter than a window": too_short} if too_short else {}),
                  len(documents))
    if not samples:
        raise ConfigError(f"empty dataset: none of {len(documents)} documents has the {needed} tokens a "
                          f"{prefix_tokens}+{continuation_tokens} window needs (longest: {longest} tokens); "
                          f"lower prefix_tokens/continuation_tokens or use longer documents")
    return samples


# --- Dispatch -----------------------------------------------------------------------------------


def build_samples(corpus: Corpus, tokenizer: Any, *, seed: int, max_prefix_tokens: int = 1024,
                  max_continuation_tokens: int = 256, prefix_tokens: int = 256, continuation_tokens: int = 64,
                  samples_per_item: int = 1) -> list[Sample]:
    """Samples for ``corpus`` and ``tokenizer``, choosing the right builder.

    * chat corpus, tokenizer with a chat template -> :func:`chat_samples` (``max_*`` caps apply);
    * chat corpus, no chat template (base models) -> each conversation flattened into text with
      :func:`flatten_conversation`, then :func:`text_samples` (``prefix_tokens`` /
      ``continuation_tokens`` windows; conversations shorter than a window are skipped, so short
      chats may need smaller windows);
    * text corpus -> :func:`text_samples` whatever the tokenizer.

    Raises:
        ConfigError: unknown corpus kind, or whatever the chosen builder raises.
    """
    if corpus.kind == "chat" and has_chat_template(tokenizer):
        return chat_samples(list(corpus.items), tokenizer, seed=seed, max_prefix_tokens=max_prefix_tokens,
                            max_continuation_tokens=max_continuation_tokens,
                            samples_per_conversation=samples_per_item)
    if corpus.kind == "chat":
        documents = [TextDocument(flatten_conversation(c)) for c in corpus.items]
    elif corpus.kind == "text":
        documents = list(corpus.items)
    else:
        raise ConfigError(f"corpus {corpus.name!r} has unknown kind {corpus.kind!r}; expected 'chat' or 'text'")
    return text_samples(documents, tokenizer, seed=seed, prefix_tokens=prefix_tokens,
                        continuation_tokens=continuation_tokens, samples_per_document=samples_per_item)


# --- Splitting and checks -----------------------------------------------------------------------


def split_by_conversation(samples: Sequence[Sample], val_fraction: float = 0.1,
                          seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """Split samples into (train, val) by source conversation, so none sits on both sides.

    ``round(val_fraction * n_conversations)`` conversations (at least one) are drawn for validation
    with an RNG fixed by ``seed``; samples keep their input order on each side.

    Raises:
        ConfigError: ``val_fraction`` outside (0, 1), or a side would be empty (too few conversations).
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be a number strictly between 0 and 1, got {val_fraction!r}")
    _check_seed(seed)
    conversations = sorted({s.conversation for s in samples})
    n_val = max(1, round(val_fraction * len(conversations)))
    if n_val >= len(conversations):
        raise ConfigError(f"cannot split {len(samples)} samples from {len(conversations)} conversation(s) with "
                          f"val_fraction={val_fraction}: one side would be empty; use more data (at least 2 "
                          f"conversations) or another val_fraction")
    val_ids = set(random.Random(seed).sample(conversations, n_val))
    train = [s for s in samples if s.conversation not in val_ids]
    val = [s for s in samples if s.conversation in val_ids]
    return train, val


def check_prefix_lengths(samples: Sequence[Sample], max_positions: int, model_name: str) -> None:
    """Check every sample fits the model: ``len(prefix) + len(continuation) <= max_positions``.

    Raises:
        PrefixTooLongError: naming the first offending sample, its lengths, and how many exceed.
    """
    too_long = [(i, s) for i, s in enumerate(samples)
                if s.prefix_ids.numel() + s.continuation_ids.numel() > max_positions]
    if too_long:
        index, sample = too_long[0]
        n, m = sample.prefix_ids.numel(), sample.continuation_ids.numel()
        raise PrefixTooLongError(
            f"sample {index} (conversation {sample.conversation}) has {n} prefix + {m} continuation = {n + m} "
            f"tokens, more than the {max_positions} positions of {model_name}; {len(too_long)} of {len(samples)} "
            f"samples exceed it. Lower max_prefix_tokens/max_continuation_tokens (or the text window lengths)")
