"""Token alignment across two tokenizers of the same text (KV-Lingo, App. K).

The source and the target tokenize one text differently. The text is cut at every character offset where
both tokenizations end a token; consecutive cuts delimit *minimal mismatching groups*, each covering the same
characters on both sides with at least one token per side. Inside a group of ``p`` source and ``q`` target
tokens, source token ``i`` (0-based) is assigned to target token ``round(i * (q - 1) / (p - 1))`` (half up),
and a lone source token to the group's first target token. Translated keys of a source token are rotated at
the position of its assigned target token; its stage-1 regression target is the mean of its group's target
rows.

Messages rendered by a chat format are located in the rendering by :func:`content_spans` and their tokens picked by
:func:`content_tokens`: the content is aligned, the format's boilerplate around it is not.

Spans are ``[start, end)`` character offsets as given by a fast HF tokenizer's ``return_offsets_mapping``.
Byte-level tokenizers split one non-ASCII character into several tokens sharing the same span: a cut never
falls between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from translators.errors import ConfigError

Span = tuple[int, int]  # [start, end) character offsets

_SIDES = ("source", "target")


class AlignmentError(ConfigError):
    """Two tokenizations of a text cannot be aligned (or a tokenizer cannot give character offsets)."""


# ---------------------------------------------------------------------- offsets from a tokenizer


def token_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[Span]]:
    """Token ids and character spans of ``text``, without special tokens.

    Returns:
        ``(ids, spans)``, both of length n_tokens; ``spans[k] = (start, end)`` with ``text[start:end]`` the
        characters of token k.

    Raises:
        AlignmentError: the tokenizer gives no offsets (a slow, python tokenizer); the message names it.
    """
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    advice = (
        f"tokenizer {name!r} gives no character offsets: load its fast tokenizer "
        "(a tokenizer.json beside the model, AutoTokenizer.from_pretrained(..., use_fast=True))"
    )
    # Slow tokenizers report is_fast False; HF raises NotImplementedError for return_offsets_mapping on them.
    if getattr(tokenizer, "is_fast", True) is False:
        raise AlignmentError(advice)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:
        raise AlignmentError(advice) from exc
    if "offset_mapping" not in encoded:
        raise AlignmentError(advice)
    ids = [int(i) for i in encoded["input_ids"]]
    spans = [(int(s), int(e)) for s, e in encoded["offset_mapping"]]
    if len(ids) != len(spans):
        raise AlignmentError(f"tokenizer {name!r} returned {len(ids)} ids but {len(spans)} offsets for one text")
    return ids, spans


# ---------------------------------------------------------------------- checks


def _check_spans(spans: Sequence[Span], side: str, text_len: int) -> None:
    """Spans lie within the text and their starts never decrease.

    Raises:
        AlignmentError: a span outside ``[0, text_len]`` or reversed, or a start before the previous start.
    """
    prev_start = 0
    for k, (start, end) in enumerate(spans):
        if not 0 <= start <= end <= text_len:
            raise AlignmentError(
                f"{side} token {k} has span ({start}, {end}), outside the text of {text_len} characters: "
                "offsets must come from tokenizing this very text"
            )
        # Offsets of one left-to-right tokenization never go back; anything else means mixed-up inputs.
        if start < prev_start:
            raise AlignmentError(
                f"{side} token {k} starts at character {start}, before token {k - 1} (start {prev_start}): "
                "spans must come from one left-to-right tokenization of the text"
            )
        prev_start = start


def _coverage(spans: Sequence[Span], text_len: int) -> list[bool]:
    """[text_len] whether each character lies in some non-empty span (difference array, O(n + text_len))."""
    delta = [0] * (text_len + 1)
    for start, end in spans:
        if start < end:
            delta[start] += 1
            delta[end] -= 1
    covered, depth = [], 0
    for c in range(text_len):
        depth += delta[c]
        covered.append(depth > 0)
    return covered


def check_same_characters(source: Sequence[Span], target: Sequence[Span], *, text: str) -> None:
    """Both tokenizations must cover the same characters of ``text`` and have non-decreasing starts.

    Coverage is the union of the non-empty spans; characters neither side covers (dropped whitespace) are fine.

    Raises:
        AlignmentError: a span outside the text, a decreasing start, or a character covered by one side's
            tokens and not the other's (the first such offset, quoted, and which side covers it).
    """
    _check_spans(source, "source", len(text))
    _check_spans(target, "target", len(text))
    by_source, by_target = _coverage(source, len(text)), _coverage(target, len(text))
    for c, (s, t) in enumerate(zip(by_source, by_target)):
        if s != t:
            has, lacks = ("source", "target") if s else ("target", "source")
            raise AlignmentError(
                "the two tokenizations do not reconstruct the same characters: "
                f"character {c} ({text[c]!r}) is covered by the {has}'s tokens but not the {lacks}'s; "
                "tokenize the same text with both tokenizers and take spans from return_offsets_mapping "
                "(a tokenizer that trims whitespace from its offsets cannot be aligned with one that keeps it)"
            )


# ---------------------------------------------------------------------- groups


@dataclass(frozen=True)
class Group:
    """One minimal mismatching group: the same characters, tokenized by both sides."""

    source: range  # indices into the source token list
    target: range  # indices into the target token list
    chars: Span  # the characters the group covers: [first start, last end)


def _cut_intervals(spans: Sequence[Span], far: int) -> list[tuple[int, int, int]]:
    """The valid cuts of one side: ``(k, lo, hi)`` for a cut before token k at any offset in ``[lo, hi]``.

    A cut before token k (k = 0..n) is valid when every token before ends at or before every token from k
    on starts: ``lo`` = max end of tokens < k, ``hi`` = min start of tokens >= k. Tokens sharing a span (one
    character in byte tokens) give lo > hi between them, so they stay together. With non-empty spans the
    intervals are disjoint and increasing (lo of the next valid cut > hi of this one).
    """
    n = len(spans)
    suffix_min_start = [far] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix_min_start[k] = min(spans[k][0], suffix_min_start[k + 1])
    cuts, prefix_max_end = [], 0
    for k in range(n + 1):
        if prefix_max_end <= suffix_min_start[k]:
            cuts.append((k, prefix_max_end, suffix_min_start[k]))
        if k < n:
            prefix_max_end = max(prefix_max_end, spans[k][1])
    return cuts


def _shared_cuts(source: Sequence[Span], target: Sequence[Span], far: int) -> list[tuple[int, int]]:
    """``(source cut, target cut)`` token indices at every character offset that is a boundary of both sides.

    Two-pointer merge of the two sides' increasing, disjoint cut intervals: a shared cut is a pair whose
    intervals intersect.
    """
    cs, ct = _cut_intervals(source, far), _cut_intervals(target, far)
    shared, a, b = [], 0, 0
    while a < len(cs) and b < len(ct):
        ks, lo_s, hi_s = cs[a]
        kt, lo_t, hi_t = ct[b]
        if max(lo_s, lo_t) <= min(hi_s, hi_t):
            shared.append((ks, kt))
            a, b = a + 1, b + 1
        elif hi_s < hi_t:
            a += 1
        else:
            b += 1
    return shared


def minimal_groups(source: Sequence[Span], target: Sequence[Span], *, text: str) -> list[Group]:
    """Cut both tokenizations at every shared boundary; return the groups between consecutive cuts.

    A boundary of a side is an offset c that no token strictly contains and that separates the tokens before
    (all ending <= c) from those after (all starting >= c). Groups are contiguous, minimal, cover every token
    of both sides once and in order, and have at least one token per side; their ``chars`` are disjoint, in
    order, and together cover every character either side covers.

    Raises:
        AlignmentError: a token with an empty span (a special token: tokenize with add_special_tokens=False
            and leave chat-template boilerplate out), or anything :func:`check_same_characters` rejects.
    """
    # Checked first: a (0, 0) special token would otherwise surface as a confusing decreasing-start error.
    for side, spans in zip(_SIDES, (source, target)):
        for k, (start, end) in enumerate(spans):
            if start >= end:
                raise AlignmentError(
                    f"{side} token {k} has the empty span ({start}, {end}), as special tokens do: tokenize "
                    "with add_special_tokens=False and leave chat-template boilerplate out of the alignment"
                )
    check_same_characters(source, target, text=text)
    shared = _shared_cuts(source, target, far=len(text) + 1)
    groups = []
    for (s0, t0), (s1, t1) in zip(shared, shared[1:]):
        if s0 == s1 and t0 == t1:
            continue  # two offsets inside one stretch of uncovered characters: nothing between them
        if s0 == s1 or t0 == t1:
            # Cannot happen once both sides cover the same characters; kept loud rather than silent.
            raise AlignmentError(
                f"internal: a group with source tokens {s0}..{s1} and target tokens {t0}..{t1} is empty on "
                "one side although both sides cover the same characters; please report this input"
            )
        # Both sides cover the same characters here, so either side's extent would do; take the union anyway.
        first = min(source[s0][0], target[t0][0])
        last = max(max(e for _, e in source[s0:s1]), max(e for _, e in target[t0:t1]))
        groups.append(Group(source=range(s0, s1), target=range(t0, t1), chars=(first, last)))
    covered_s = groups[-1].source.stop if groups else 0
    covered_t = groups[-1].target.stop if groups else 0
    if covered_s != len(source) or covered_t != len(target):
        raise AlignmentError(
            f"internal: the groups cover {covered_s}/{len(source)} source and {covered_t}/{len(target)} "
            "target tokens; please report this input"
        )
    return groups


# ---------------------------------------------------------------------- assignment


def spread(p: int, q: int) -> list[int]:
    """The target index (0..q-1) assigned to each of p source tokens of one group, spread evenly.

    ``j(i) = floor(i * (q - 1) / (p - 1) + 1/2)`` for p >= 2, in exact integer arithmetic (no float ties);
    ``[0]`` for p == 1. Non-decreasing, ``j(0) = 0`` and ``j(p - 1) = q - 1``.

    Returns:
        [p] list of ints.

    Raises:
        AlignmentError: p < 1 or q < 1 (a group has at least one token on each side).
    """
    if p < 1 or q < 1:
        raise AlignmentError(f"a group needs at least one token on each side, got p={p} source and q={q} target")
    if p == 1:
        return [0]
    # floor(i(q-1)/(p-1) + 1/2) == floor((2 i (q-1) + (p-1)) / (2 (p-1))): round half up, exactly.
    return [(2 * i * (q - 1) + (p - 1)) // (2 * (p - 1)) for i in range(p)]


@dataclass(frozen=True)
class Alignment:
    """Minimal groups of two tokenizations and the target token each source token is rotated at."""

    groups: tuple[Group, ...]
    n_source: int
    n_target: int
    assigned: tuple[int, ...]  # [n_source] target token index each source token is rotated at
    group_of_source: tuple[int, ...]  # [n_source] index into groups
    group_of_target: tuple[int, ...]  # [n_target] index into groups

    def one_to_one_share(self) -> float:
        """Fraction of groups holding one token on each side (0.0 when there are no groups)."""
        if not self.groups:
            return 0.0
        return sum(len(g.source) == 1 and len(g.target) == 1 for g in self.groups) / len(self.groups)

    def group_means(self, target_rows: torch.Tensor) -> torch.Tensor:
        """Each source token's stage-1 regression target: the mean of its group's target rows.

        In a 1:1 group this is the assigned row itself, exactly.

        Args:
            target_rows: [n_target, d] (any trailing shape) floating-point rows, one per target token.

        Returns:
            [n_source, d], same dtype and device as ``target_rows``.

        Raises:
            AlignmentError: ``target_rows`` does not have n_target rows, or is not floating point.
        """
        if target_rows.ndim < 1 or target_rows.shape[0] != self.n_target:
            raise AlignmentError(
                f"target_rows has shape {tuple(target_rows.shape)} but the alignment has {self.n_target} target "
                "tokens: pass the target's rows for exactly the tokens that were aligned (no special tokens)"
            )
        if not target_rows.is_floating_point():
            raise AlignmentError(f"target_rows must be floating point to be averaged, got {target_rows.dtype}")
        device = target_rows.device
        # Half-precision sums lose digits: accumulate in fp32 at least, cast back at the end.
        acc_dtype = torch.promote_types(target_rows.dtype, torch.float32)
        of_target = torch.tensor(self.group_of_target, dtype=torch.long, device=device)
        of_source = torch.tensor(self.group_of_source, dtype=torch.long, device=device)
        n_groups = len(self.groups)
        sums = torch.zeros((n_groups, *target_rows.shape[1:]), dtype=acc_dtype, device=device)
        sums.index_add_(0, of_target, target_rows.to(acc_dtype))
        counts = torch.bincount(of_target, minlength=n_groups).to(acc_dtype)
        means = sums / counts.reshape(n_groups, *([1] * (target_rows.ndim - 1)))
        return means.index_select(0, of_source).to(target_rows.dtype)

    def summary(self) -> dict:
        """JSON-able counts: n_source, n_target, n_groups, one_to_one_share."""
        return {
            "n_source": self.n_source,
            "n_target": self.n_target,
            "n_groups": len(self.groups),
            "one_to_one_share": self.one_to_one_share(),
        }


def align(source: Sequence[Span], target: Sequence[Span], *, text: str) -> Alignment:
    """Minimal groups of the two tokenizations, then :func:`spread` inside each group.

    Returns:
        An :class:`Alignment` whose ``assigned[i]`` is the global target index source token i is rotated at.

    Raises:
        AlignmentError: see :func:`minimal_groups`.
    """
    groups = minimal_groups(source, target, text=text)
    assigned: list[int] = []
    group_of_source: list[int] = []
    group_of_target: list[int] = []
    for g_index, g in enumerate(groups):
        assigned.extend(g.target.start + j for j in spread(len(g.source), len(g.target)))
        group_of_source.extend([g_index] * len(g.source))
        group_of_target.extend([g_index] * len(g.target))
    return Alignment(
        groups=tuple(groups),
        n_source=len(source),
        n_target=len(target),
        assigned=tuple(assigned),
        group_of_source=tuple(group_of_source),
        group_of_target=tuple(group_of_target),
    )


# ---------------------------------------------------------------------- message content inside a rendering


def content_spans(text: str, messages: Sequence[Any]) -> list[Span | None]:
    """Where each message's (stripped) content sits in a rendering ``text``, searched in order; None where the
    format changed it beyond recognition (or the content is empty).

    Args:
        messages: ``{"role", "content"}`` mappings, in the order the rendering writes them.
    Returns:
        [len(messages)] character spans ``(start, end)`` into ``text``, or None.
    """
    spans: list[Span | None] = []
    cursor = 0
    for message in messages:
        content = str(message.get("content", "")).strip()
        start = text.find(content, cursor) if content else -1
        if start < 0:
            spans.append(None)
            continue
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def content_tokens(text: str, offsets: Sequence[Span], span: Span) -> tuple[list[int], list[Span]]:
    """Tokens of a rendering that belong to the content ``span``: those overlapping it whose characters outside
    it are whitespace only (SentencePiece's "▁Hello", byte-level BPE's "ĠHello" reach into the template's space).

    Returns:
        ``(indices, clipped)``: indices into ``offsets``, and each token's span clipped to the content, relative
        to the content's start (what :func:`align` takes for the content's text).
    """
    a, b = span
    indices, clipped = [], []
    for i, (s, e) in enumerate(offsets):
        if e <= a or s >= b or s >= e:
            continue
        outside = text[s:max(s, a)] + text[min(e, b):e]
        if outside.strip():
            continue
        indices.append(i)
        clipped.append((max(s, a) - a, min(e, b) - a))
    return indices, clipped
