"""Character offsets and alignment on real tokenizers: the embedded pair's BPE (built on first use, seconds) and
SmolLM2's byte-level BPE from its GGUF package, across a tokenizer boundary with non-ASCII text."""

import pytest

from translators.alignment import align, token_offsets

pytestmark = pytest.mark.integration

TEXT = "Summarise this unbelievably long prefix about a café in Zürich."


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from infra import tiny_models
    from infra.settings import kvlingo_home

    return AutoTokenizer.from_pretrained(str(tiny_models._ensure_tokenizer(kvlingo_home() / "models")))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from infra.zoo import load_model

    return load_model("smollm2-135m-instruct").tokenizer


def test_real_tokenizer_offsets_reconstruct_the_text(embedded_tokenizer, smollm2_tokenizer):
    """A byte-level BPE may split a non-ASCII character into byte tokens that share the character's span (the
    embedded tokenizer does for "é" and "ü"): the distinct spans, in order, reconstruct the text."""
    for tokenizer in (embedded_tokenizer, smollm2_tokenizer):
        ids, spans = token_offsets(tokenizer, TEXT)
        assert len(ids) == len(spans) > 0
        distinct = [span for i, span in enumerate(spans) if i == 0 or span != spans[i - 1]]
        assert "".join(TEXT[s:e] for s, e in distinct) == TEXT
    _, embedded_spans = token_offsets(embedded_tokenizer, TEXT)
    assert len(embedded_spans) > len(set(embedded_spans))  # the shared byte-token spans are really there


def test_real_tokenizers_align_across_a_tokenizer_boundary(embedded_tokenizer, smollm2_tokenizer):
    _, source = token_offsets(embedded_tokenizer, TEXT)
    _, target = token_offsets(smollm2_tokenizer, TEXT)
    alignment = align(source, target, text=TEXT)
    assert alignment.n_source == len(source) and alignment.n_target == len(target)
    assert 0.0 < alignment.one_to_one_share() <= 1.0
    assert list(alignment.assigned) == sorted(alignment.assigned)
