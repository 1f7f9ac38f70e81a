"""Cross-tokenizer training samples: each model renders the conversation in its own format (App. K).

The source and the target each render ``messages[:t]`` with their own chat template (a base model without one
gets the plain ``"User: …\\nAssistant:"`` format of `infra.chat`, after the BOS its tokenizer adds by itself).
The messages' contents are located in both renders and aligned token group by token group
(`translators.alignment`); everything else (BOS, system prompts only one template injects, turn delimiters,
role headers, the generation header) is boilerplate: it has no counterpart, so the target prefills it itself.
The continuation is the answer of turn ``t`` in the target's format and tokens.

Content tokens at the edges of a message may reach past it into whitespace of the template (SentencePiece's
"▁Hello", byte-level BPE's "ĠHello"): such a token still counts as content, its span clipped to the message.
A token that reaches past the message into non-whitespace belongs to the boilerplate; if that leaves the two
sides covering different characters of the message, the whole message is treated as boilerplate (counted in
the log) rather than aligned wrongly.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from infra.chat import has_chat_template, render_chat
from infra.conversations import Conversation
from infra.samples import _eligible_turns, _leading_special_ids, _render_pair, _rng
from translators.alignment import AlignmentError, Span, align, content_spans, content_tokens, token_offsets
from translators.cross import CrossSample
from translators.cross_conversation import ModelFormat
from translators.errors import ConfigError

log = logging.getLogger(__name__)


def render_prefix(tokenizer: Any, messages: Conversation) -> tuple[str, list[int], list[Span]]:
    """A model's own rendering of `messages` up to its generation header: (text, ids, offsets).

    Leading special tokens the tokenizer adds by itself (Gemma's BOS) come first with empty spans (0, 0)
    when the model has no chat template (a template writes its BOS into the text itself).

    Raises:
        AlignmentError: the tokenizer gives no character offsets.
    """
    fmt = model_format(tokenizer)
    text = fmt.render(messages, generation_prompt=True)
    ids, offsets = fmt.tokens(text, first=True)
    return text, ids, offsets


def model_format(tokenizer: Any) -> ModelFormat:
    """How a model writes a conversation, for `translators.cross_conversation`: `infra.chat.render_chat` with its
    tokenizer, plus the leading special tokens its tokenizer adds by itself when it has no chat template (a
    template writes its BOS into the text itself)."""
    lead = () if has_chat_template(tokenizer) else tuple(_leading_special_ids(tokenizer))
    return ModelFormat(tokenizer, partial(render_chat, tokenizer), lead)


def cross_prompt(
    source_tokenizer: Any, target_tokenizer: Any, context: Conversation, *, max_prefix_tokens: int,
    continuation_ids: Sequence[int] = (), conversation: int = 0, skipped: Counter | None = None,
) -> CrossSample | None:
    """Both models' renderings of `context` up to their generation headers, aligned; the continuation (target
    token ids) is empty for a prompt that is only decoded from. None (reason counted in `skipped`) when a prefix
    exceeds `max_prefix_tokens` or no content aligns.

    Raises:
        AlignmentError: a tokenizer without offsets.
    """
    skipped = Counter() if skipped is None else skipped
    src_text, src_ids, src_off = render_prefix(source_tokenizer, context)
    tgt_text, tgt_ids, tgt_off = render_prefix(target_tokenizer, context)
    if max(len(src_ids), len(tgt_ids)) > max_prefix_tokens:
        skipped["prefixes over max_prefix_tokens"] += 1
        return None
    translated, positions, source_group, target_group = [], [], [], [-1] * len(tgt_ids)
    n_groups = 0
    for s_span, t_span in zip(content_spans(src_text, context), content_spans(tgt_text, context)):
        if s_span is None or t_span is None:
            skipped["messages a template changed (prefilled)"] += 1
            continue
        s_idx, s_rel = content_tokens(src_text, src_off, s_span)
        t_idx, t_rel = content_tokens(tgt_text, tgt_off, t_span)
        try:
            alignment = align(s_rel, t_rel, text=src_text[s_span[0]:s_span[1]])
        except AlignmentError:
            skipped["messages whose edge tokens do not align (prefilled)"] += 1
            continue
        for i, (assigned, group) in enumerate(zip(alignment.assigned, alignment.group_of_source)):
            translated.append(s_idx[i])
            positions.append(t_idx[assigned])
            source_group.append(n_groups + group)
        for j, group in enumerate(alignment.group_of_target):
            target_group[t_idx[j]] = n_groups + group
        n_groups += len(alignment.groups)
    if not translated:
        skipped["prefixes without aligned content"] += 1
        return None
    if target_group[-1] != -1:
        skipped["renders ending in content"] += 1
        return None
    long = lambda xs: torch.tensor(list(xs), dtype=torch.long)  # noqa: E731
    return CrossSample(long(src_ids), long(tgt_ids), long(continuation_ids), long(translated), long(positions),
                       long(source_group), long(target_group), conversation)


def cross_sample(
    source_tokenizer: Any, target_tokenizer: Any, messages: Conversation, turn: int, conversation: int, *,
    max_prefix_tokens: int, max_continuation_tokens: int, skipped: Counter | None = None,
) -> CrossSample | None:
    """The training sample of assistant turn `turn`: `cross_prompt` of messages[:turn] with the answer in the
    target's format as continuation; None (reason counted in `skipped`) when the target's answer is not found or
    `cross_prompt` gives none.

    Raises:
        AlignmentError: a tokenizer without offsets.
    """
    skipped = Counter() if skipped is None else skipped
    pair = _render_pair(target_tokenizer, messages, turn)
    if pair is None:
        skipped["answers not found in the target's render"] += 1
        return None
    continuation = list(target_tokenizer(pair[1], add_special_tokens=False)["input_ids"])[:max_continuation_tokens]
    if not continuation:
        skipped["empty continuations"] += 1
        return None
    return cross_prompt(source_tokenizer, target_tokenizer, messages[:turn], max_prefix_tokens=max_prefix_tokens,
                        continuation_ids=continuation, conversation=conversation, skipped=skipped)


def cross_chat_samples(
    conversations: Sequence[Conversation], source_tokenizer: Any, target_tokenizer: Any, *, seed: int,
    max_prefix_tokens: int = 1024, max_continuation_tokens: int = 256, samples_per_conversation: int = 1,
) -> list[CrossSample]:
    """Samples cut at random assistant turns, as `infra.samples.chat_samples` draws them (same RNG per item).

    Raises:
        AlignmentError: a tokenizer without character offsets (slow tokenizer).
        ConfigError: no conversation gave a sample.
    """
    samples: list[CrossSample] = []
    skipped: Counter = Counter()
    for index, messages in enumerate(conversations):
        turns = _eligible_turns(messages)
        if not turns:
            skipped["conversations without an assistant turn after context"] += 1
            continue
        rng = _rng(seed, index)
        for turn in sorted(rng.sample(turns, min(samples_per_conversation, len(turns)))):
            sample = cross_sample(source_tokenizer, target_tokenizer, messages, turn, index,
                                  max_prefix_tokens=max_prefix_tokens, max_continuation_tokens=max_continuation_tokens,
                                  skipped=skipped)
            if sample is not None:
                samples.append(sample)
    if skipped:
        log.warning("cross_chat_samples: %s", ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    if not samples:
        raise ConfigError(f"empty dataset: none of {len(conversations)} conversations gave a cross-tokenizer sample "
                          f"({', '.join(f'{n} {why}' for why, n in sorted(skipped.items()))})")
    return samples


def cross_prompt_of_length(source_tokenizer: Any, target_tokenizer: Any, n_tokens: int, seed: int = 0) -> CrossSample:
    """A one-message conversation of synthetic text whose rendering by the target holds about `n_tokens` tokens
    (within a token where the re-rendered text allows: the text is cut at a target token boundary, rendered, and the
    cut moved by the shortfall), aligned with the source's.

    Raises:
        ConfigError: n_tokens too small for the target's template, or no content aligns.
    """
    from infra.prompts import prompt_of_length

    overhead = len(render_prefix(target_tokenizer, [{"role": "user", "content": "x"}])[1]) - 1
    if n_tokens - overhead < 2:
        raise ConfigError(f"a prompt of {n_tokens} tokens leaves no room for content after the target's "
                          f"{overhead}-token template")
    content = n_tokens - overhead
    for _ in range(4):  # re-rendering may merge or drop tokens at the cut (e.g. <unk> decodes to nothing): adjust
        ids = prompt_of_length(target_tokenizer, content, seed=seed)
        text = target_tokenizer.decode(ids, skip_special_tokens=True).strip()
        sample = cross_prompt(source_tokenizer, target_tokenizer, [{"role": "user", "content": text}],
                              max_prefix_tokens=10 * n_tokens)
        if sample is None:
            raise ConfigError("the synthetic prompt gave no aligned content between the two tokenizers")
        shortfall = n_tokens - sample.target_ids.numel()
        if abs(shortfall) <= 1:
            break
        content = max(2, content + shortfall)
    return sample


# --- Plain text: long prefixes from documents ------------------------------------------------------------------


def cross_text_prompt(
    source_tokenizer: Any, target_tokenizer: Any, text: str, *, continuation_ids: Sequence[int] = (),
    conversation: int = 0,
) -> CrossSample | None:
    """A plain-text prefix read by both models (each after the BOS its tokenizer adds by itself), aligned over the
    whole text. The target decodes its last prefix token with the continuation, so the alignment group holding it
    is left to the target (prefilled; its source tokens are not translated). None when nothing else aligns.

    Raises:
        AlignmentError: a tokenizer without offsets, or tokenizations covering different characters of `text`.
    """
    src_ids, src_off = token_offsets(source_tokenizer, text)
    tgt_ids, tgt_off = token_offsets(target_tokenizer, text)
    src_lead, tgt_lead = _leading_special_ids(source_tokenizer), _leading_special_ids(target_tokenizer)
    alignment = align(src_off, tgt_off, text=text)
    last = len(alignment.groups) - 1
    keep = [i for i, g in enumerate(alignment.group_of_source) if g < last]
    if not keep:
        return None
    target_group = [-1] * len(tgt_lead) + [g if g < last else -1 for g in alignment.group_of_target]
    long = lambda xs: torch.tensor(list(xs), dtype=torch.long)  # noqa: E731
    return CrossSample(
        long(src_lead + src_ids), long(tgt_lead + tgt_ids), long(continuation_ids),
        translated=long(len(src_lead) + i for i in keep),
        positions=long(len(tgt_lead) + alignment.assigned[i] for i in keep),
        source_group=long(alignment.group_of_source[i] for i in keep),
        target_group=long(target_group), conversation=conversation,
    )


def cross_text_samples(
    documents: Sequence[Any], source_tokenizer: Any, target_tokenizer: Any, *, seed: int, prefix_tokens: int = 1024,
    continuation_tokens: int = 64,
) -> list[CrossSample]:
    """One random window per document (as `infra.samples.text_samples` draws them, in target tokens): the text of
    `prefix_tokens` target tokens as the prefix (`cross_text_prompt`), the next `continuation_tokens` target tokens
    as the continuation. For prefixes longer than the chats (e.g. the RULER essays).

    Raises:
        ConfigError: no document holds a window.
        AlignmentError: a tokenizer without offsets.
    """
    samples: list[CrossSample] = []
    needed = prefix_tokens + continuation_tokens
    for index, document in enumerate(documents):
        text = document.text if hasattr(document, "text") else str(document)
        ids, offsets = token_offsets(target_tokenizer, text)
        if len(ids) < needed:
            continue
        start = _rng(seed, index).randint(0, len(ids) - needed)
        cut = offsets[start + prefix_tokens - 1][1]
        sample = cross_text_prompt(source_tokenizer, target_tokenizer, text[offsets[start][0]:cut],
                                   continuation_ids=ids[start + prefix_tokens:start + needed], conversation=index)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ConfigError(f"empty dataset: none of {len(documents)} documents holds a {prefix_tokens}+"
                          f"{continuation_tokens}-token window of the target's tokens")
    return samples
