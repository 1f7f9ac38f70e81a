"""Unit tests of cross-tokenizer alignment: minimal groups, the even spread, group means and the errors.

Properties run on random texts with random tokenizations: random cut points, characters split into 2-4 byte
tokens sharing one span (as byte-level BPE does for non-ASCII), and characters neither side covers (gaps).
The groups are checked against a brute-force reference that enumerates every character offset.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from translators.alignment import (
    Alignment,
    AlignmentError,
    Group,
    align,
    check_same_characters,
    minimal_groups,
    spread,
    token_offsets,
)
from translators.errors import ConfigError

ALPHABET = "ab é中\n"
FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------- random tokenizations


@st.composite
def coverage(draw) -> tuple[str, list[bool]]:
    """A text and which of its characters the tokenizations cover (mostly covered; some gaps)."""
    text = draw(st.text(alphabet=ALPHABET, max_size=30))
    covered = draw(st.lists(st.sampled_from([True, True, True, True, False]), min_size=len(text), max_size=len(text)))
    return text, covered


def _runs(covered: list[bool]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of covered characters."""
    runs, start = [], None
    for c, cov in enumerate([*covered, False]):
        if cov and start is None:
            start = c
        elif not cov and start is not None:
            runs.append((start, c))
            start = None
    return runs


@st.composite
def tokenization(draw, covered: list[bool]) -> list[tuple[int, int]]:
    """Spans covering exactly the covered characters: random cuts inside each run, and some one-character
    tokens split into 2-4 byte tokens that all carry the same span."""
    spans = []
    for a, b in _runs(covered):
        cuts = sorted(draw(st.sets(st.integers(a + 1, b - 1), max_size=b - a - 1)) if b - a > 1 else set())
        edges = [a, *cuts, b]
        for start, end in zip(edges, edges[1:]):
            copies = draw(st.sampled_from([1, 1, 1, 2, 3, 4])) if end - start == 1 else 1
            spans.extend([(start, end)] * copies)
    return spans


@st.composite
def pair(draw) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """A text and two independent tokenizations of it that cover the same characters."""
    text, covered = draw(coverage())
    return text, draw(tokenization(covered)), draw(tokenization(covered))


# ---------------------------------------------------------------------- brute-force references


def _boundaries(spans: list[tuple[int, int]], text_len: int) -> set[int]:
    """Every offset c that no token strictly contains, with all tokens before ending <= c and all after
    starting >= c, straight from the definition."""
    out = set()
    for c in range(text_len + 1):
        if any(s < c < e for s, e in spans):
            continue
        if any(all(e <= c for _, e in spans[:k]) and all(s >= c for s, _ in spans[k:]) for k in range(len(spans) + 1)):
            out.add(c)
    return out


def _reference_groups(text: str, source, target) -> list[tuple[range, range]]:
    """Groups between consecutive shared boundaries, found by enumerating offsets; empty stretches dropped."""
    shared = sorted(_boundaries(source, len(text)) & _boundaries(target, len(text)))
    before = lambda spans, c: sum(e <= c for _, e in spans)  # noqa: E731 - tokens before a boundary
    groups = []
    for c0, c1 in zip(shared, shared[1:]):
        rs, rt = range(before(source, c0), before(source, c1)), range(before(target, c0), before(target, c1))
        if len(rs) or len(rt):
            groups.append((rs, rt))
    return groups


def _covered_set(spans) -> set[int]:
    return {c for s, e in spans for c in range(s, e)}


# ---------------------------------------------------------------------- groups: properties


@FAST
@given(pair())
def test_groups_match_the_brute_force_reference(case):
    text, source, target = case
    groups = minimal_groups(source, target, text=text)
    assert [(g.source, g.target) for g in groups] == _reference_groups(text, source, target)


@FAST
@given(pair())
def test_groups_cover_every_token_once_in_order_and_tile_the_characters(case):
    text, source, target = case
    groups = minimal_groups(source, target, text=text)
    assert [i for g in groups for i in g.source] == list(range(len(source)))
    assert [j for g in groups for j in g.target] == list(range(len(target)))
    chars_seen: set[int] = set()
    last_end = 0
    for g in groups:
        assert len(g.source) >= 1 and len(g.target) >= 1
        assert g.source.step == 1 and g.target.step == 1
        covered_s = _covered_set(source[g.source.start : g.source.stop])
        covered_t = _covered_set(target[g.target.start : g.target.stop])
        # Same characters on both sides, and exactly the group's chars: no gap inside a group.
        assert covered_s == covered_t == set(range(*g.chars))
        assert g.chars[0] >= last_end  # disjoint and in order
        last_end = g.chars[1]
        chars_seen |= covered_s
    assert chars_seen == _covered_set(source)


@FAST
@given(pair())
def test_groups_are_minimal(case):
    text, source, target = case
    shared = _boundaries(source, len(text)) & _boundaries(target, len(text))
    for g in minimal_groups(source, target, text=text):
        interior = set(range(g.chars[0] + 1, g.chars[1]))
        assert not interior & shared, f"group {g} could be split at {sorted(interior & shared)}"


@FAST
@given(pair())
def test_byte_tokens_sharing_a_span_stay_in_one_group(case):
    text, source, target = case
    alignment = align(source, target, text=text)
    for spans, of in ((source, alignment.group_of_source), (target, alignment.group_of_target)):
        for k in range(1, len(spans)):
            if spans[k] == spans[k - 1]:
                assert of[k] == of[k - 1]


@FAST
@given(coverage().flatmap(lambda tc: st.tuples(st.just(tc[0]), tokenization(tc[1]))))
def test_identical_tokenizations_are_all_one_to_one_except_shared_spans(case):
    text, spans = case
    alignment = align(spans, spans, text=text)
    assert alignment.assigned == tuple(range(len(spans)))
    # Byte tokens sharing a span cannot be cut apart, so only tokenizations without them are all 1:1.
    if len(set(spans)) == len(spans):
        assert all(len(g.source) == len(g.target) == 1 for g in alignment.groups)
        assert alignment.one_to_one_share() == (1.0 if spans else 0.0)


@FAST
@given(pair())
def test_one_to_one_groups_map_token_to_token_and_assignment_is_monotone(case):
    text, source, target = case
    alignment = align(source, target, text=text)
    assert len(alignment.assigned) == alignment.n_source == len(source)
    assert list(alignment.assigned) == sorted(alignment.assigned)
    for g_index, g in enumerate(alignment.groups):
        picked = [alignment.assigned[i] for i in g.source]
        assert all(j in g.target for j in picked)
        assert picked[0] == g.target.start  # the group's ends map to each other
        if len(g.source) >= 2:
            assert picked[-1] == g.target.stop - 1
        if len(g.source) == len(g.target) == 1:
            assert picked == [g.target.start]
        assert all(alignment.group_of_source[i] == g_index for i in g.source)
        assert all(alignment.group_of_target[j] == g_index for j in g.target)


# ---------------------------------------------------------------------- spread


@given(st.integers(1, 300), st.integers(1, 300))
@settings(deadline=None)
def test_spread_is_monotone_in_range_and_hits_both_ends(p, q):
    js = spread(p, q)
    assert len(js) == p
    assert js == sorted(js)
    assert all(0 <= j < q for j in js)
    assert js[0] == 0
    if p >= 2:
        assert js[-1] == q - 1


def test_spread_matches_float_and_fraction_references_for_small_groups():
    for p in range(1, 40):
        for q in range(1, 40):
            js = spread(p, q)
            if p == 1:
                assert js == [0]
                continue
            assert js == [math.floor(i * (q - 1) / (p - 1) + 0.5) for i in range(p)], (p, q)
            assert js == [math.floor(Fraction(i * (q - 1), p - 1) + Fraction(1, 2)) for i in range(p)], (p, q)


def test_spread_rounds_half_up_and_is_identity_for_equal_sizes():
    assert spread(3, 2) == [0, 1, 1]  # 0.5 rounds up
    assert spread(5, 3) == [0, 1, 1, 2, 2]  # 0.5 -> 1, 1.5 -> 2
    assert spread(2, 5) == [0, 4]
    for n in range(1, 30):
        assert spread(n, n) == list(range(n))


@pytest.mark.parametrize(("p", "q"), [(0, 3), (-1, 1), (2, 0), (1, 0)])
def test_spread_rejects_empty_sides(p, q):
    with pytest.raises(AlignmentError, match="at least one token on each side"):
        spread(p, q)


# ---------------------------------------------------------------------- group means


def _reference_means(alignment: Alignment, rows: torch.Tensor) -> torch.Tensor:
    out = []
    for i in range(alignment.n_source):
        g = alignment.groups[alignment.group_of_source[i]]
        acc = [0.0] * rows.shape[1]
        for j in g.target:
            for k, x in enumerate(rows[j].tolist()):
                acc[k] += x
        out.append([x / len(g.target) for x in acc])
    return torch.tensor(out, dtype=torch.float64).reshape(alignment.n_source, rows.shape[1])


@FAST
@given(pair(), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_group_means_match_a_python_loop_reference(case, d, seed):
    text, source, target = case
    alignment = align(source, target, text=text)
    rows = torch.randn(len(target), d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    means = alignment.group_means(rows)
    assert means.dtype == torch.float64 and means.shape == (len(source), d)
    torch.testing.assert_close(means, _reference_means(alignment, rows), rtol=1e-12, atol=1e-12)
    for i, g_index in enumerate(alignment.group_of_source):
        g = alignment.groups[g_index]
        if len(g.source) == len(g.target) == 1:
            assert torch.equal(means[i], rows[alignment.assigned[i]])  # the row itself, bit for bit


def test_group_means_keeps_half_dtype_and_rejects_wrong_rows():
    text = "café"
    alignment = align([(0, 3), (3, 4), (3, 4)], [(0, 2), (2, 4)], text=text)
    rows = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.bfloat16)
    means = alignment.group_means(rows)
    assert means.dtype == torch.bfloat16
    assert means.tolist() == [[2.0, 4.0]] * 3
    with pytest.raises(AlignmentError, match="2 target tokens"):
        alignment.group_means(torch.zeros(3, 2))
    with pytest.raises(AlignmentError, match="floating point"):
        alignment.group_means(torch.zeros(2, 2, dtype=torch.long))


# ---------------------------------------------------------------------- worked examples


def _spans(pieces: list[str]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for piece in pieces:
        spans.append((at, at + len(piece)))
        at += len(piece)
    return spans


def test_figure_26_example():
    text = "Summarise this unbelievably long prefix"
    source = ["Sum", "mar", "ise", " this", " unbelie", "vably", " long", " prefix"]
    target = ["Summar", "ise", " this", " un", "believ", "ably", " long", " pre", "fix"]
    assert "".join(source) == "".join(target) == text
    alignment = align(_spans(source), _spans(target), text=text)
    assert [(list(g.source), list(g.target)) for g in alignment.groups] == [
        ([0, 1], [0]),  # Sum|mar -> Summar: both on it
        ([2], [1]),
        ([3], [2]),
        ([4, 5], [3, 4, 5]),  # unbelie|vably over un|believ|ably: the ends, "believ" gets none
        ([6], [6]),
        ([7], [7, 8]),  # a single source token goes to the group's first target token
    ]
    assert alignment.assigned == (0, 0, 1, 2, 3, 5, 6, 7)
    assert [text[slice(*g.chars)] for g in alignment.groups] == [
        "Summar", "ise", " this", " unbelievably", " long", " prefix"
    ]
    assert alignment.summary() == {"n_source": 8, "n_target": 9, "n_groups": 6, "one_to_one_share": 0.5}


def test_byte_tokens_are_never_cut_apart():
    text = "café!"
    # Byte-level source: "é" as two tokens sharing the span (3, 4).
    source = [(0, 3), (3, 4), (3, 4), (4, 5)]
    alignment = align(source, [(0, 3), (3, 4), (4, 5)], text=text)
    assert [(list(g.source), list(g.target)) for g in alignment.groups] == [([0], [0]), ([1, 2], [1]), ([3], [2])]
    assert alignment.assigned == (0, 1, 1, 2)
    # Against a target that cuts inside "café", only the text's ends are shared.
    alignment = align(source, [(0, 2), (2, 5)], text=text)
    assert [(list(g.source), list(g.target)) for g in alignment.groups] == [([0, 1, 2, 3], [0, 1])]
    assert alignment.assigned == (0, 0, 1, 1)


def test_gaps_both_sides_drop_are_skipped():
    text = "ab  cd"
    # Both drop the two spaces; the target splits "cd", the source does not.
    alignment = align([(0, 2), (4, 6)], [(0, 1), (1, 2), (4, 5), (5, 6)], text=text)
    assert [g.chars for g in alignment.groups] == [(0, 2), (4, 6)]
    assert alignment.assigned == (0, 2)


def test_empty_tokenizations_align_to_nothing():
    alignment = align([], [], text="")
    assert alignment.groups == () and alignment.assigned == ()
    assert alignment.one_to_one_share() == 0.0
    assert alignment.group_means(torch.zeros(0, 3, dtype=torch.float64)).shape == (0, 3)


def test_group_is_a_frozen_dataclass():
    g = Group(source=range(0, 1), target=range(0, 2), chars=(0, 3))
    with pytest.raises(AttributeError):
        g.chars = (0, 1)  # type: ignore[misc]


# ---------------------------------------------------------------------- errors


def test_alignment_error_is_a_config_error():
    assert issubclass(AlignmentError, ConfigError)


def test_characters_covered_by_one_side_only_are_named():
    text = "a bonne idée de café"
    source = _spans(["a", " bonne", " idée", " de", " caf", "é"])
    target = source[:-1]  # the target misses the final "é" at offset 19
    with pytest.raises(AlignmentError) as caught:
        check_same_characters(source, target, text=text)
    assert "character 19 ('é') is covered by the source's tokens but not the target's" in str(caught.value)
    with pytest.raises(AlignmentError, match=r"character 19 \('é'\) is covered by the target's tokens"):
        minimal_groups(target, source, text=text)


def test_trimmed_whitespace_on_one_side_is_rejected():
    text = "ab cd"
    with pytest.raises(AlignmentError, match=r"character 2 \(' '\) is covered by the source's"):
        align([(0, 2), (2, 5)], [(0, 2), (3, 5)], text=text)


def test_decreasing_starts_and_out_of_range_spans_are_rejected():
    with pytest.raises(AlignmentError, match="left-to-right"):
        check_same_characters([(2, 4), (0, 2)], [(0, 4)], text="abcd")
    with pytest.raises(AlignmentError, match="outside the text"):
        check_same_characters([(0, 5)], [(0, 5)], text="abcd")


def test_special_tokens_with_empty_spans_are_rejected():
    with pytest.raises(AlignmentError, match="add_special_tokens=False"):
        minimal_groups([(0, 0), (0, 4)], [(0, 4)], text="abcd")
    with pytest.raises(AlignmentError, match="target token 1 has the empty span"):
        align([(0, 4)], [(0, 4), (4, 4)], text="abcd")


class _FakeTokenizer:
    """Stands in for an HF tokenizer: splits on spaces and keeps each space with the next word."""

    name_or_path = "fake/words"

    def __init__(self, *, is_fast: bool = True, offsets: bool = True):
        self.is_fast, self.offsets = is_fast, offsets

    def __call__(self, text, *, add_special_tokens=True, return_offsets_mapping=False):
        assert add_special_tokens is False
        if return_offsets_mapping and not self.offsets:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        spans, start = [], 0
        for k in range(1, len(text) + 1):
            if k == len(text) or text[k] == " ":
                spans.append((start, k))
                start = k
        out = {"input_ids": list(range(len(spans)))}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out


def test_token_offsets_of_a_fast_tokenizer():
    ids, spans = token_offsets(_FakeTokenizer(), "one two three")
    assert ids == [0, 1, 2]
    assert spans == [(0, 3), (3, 7), (7, 13)]


def test_token_offsets_of_a_slow_tokenizer_says_to_load_the_fast_one():
    with pytest.raises(AlignmentError, match="fast") as caught:
        token_offsets(_FakeTokenizer(offsets=False, is_fast=True), "one two")
    assert "fake/words" in str(caught.value) and "use_fast=True" in str(caught.value)
    assert isinstance(caught.value.__cause__, NotImplementedError)
    with pytest.raises(AlignmentError, match="fake/words.*fast"):
        token_offsets(_FakeTokenizer(is_fast=False), "one two")
