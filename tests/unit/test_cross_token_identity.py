"""Token identity across tokenizers (`translators.cross.aligned_token_ids`): the `ids` variant reads the target's
embedding of the target token each translated source token is assigned to (App. K's j(i)).

Pair, tokenizers and samples come from tests/unit/test_cross_tokenizer.py (A: byte-level BPE + ChatML on a tiny
Llama; B: "▁word" BPE on a tiny Gemma-3, whose input embedding is scaled). References are plain tensor algebra:
the target ids are read off `target_ids` at the sample's positions by index, the embedding rows through the
target's own embedding module, and the maps are compared with `torch.linalg.lstsq` on the explicit design.
"""

import pytest
import torch
from test_cross_tokenizer import gemma_b, llama_a, samples_ab, tok_a, tok_b  # noqa: F401 (fixtures)

from translators.capture import capture
from translators.cross import accumulate_cross, accumulate_samples, aligned_token_ids, source_capture, translated_tensors
from translators.errors import ConfigError
from translators.stage1 import candidate_layers, empty_stats, solve_translator
from translators.token_identity import TokenIdentity, make_token_identity, target_embedding


def _embedding_rows(side, ids):
    """The target's input embedding of `ids` through its own module (Gemma's scale included): [n, d_model]."""
    with torch.no_grad():
        return side.model.get_input_embeddings()(ids.view(1, -1))[0].double()


def test_aligned_ids_are_the_target_tokens_at_the_assigned_positions(samples_ab):
    for sample in samples_ab:
        ids = aligned_token_ids(sample)
        assert ids.shape == sample.translated.shape
        for k, position in enumerate(sample.positions.tolist()):
            assert int(ids[k]) == int(sample.target_ids[position])
            assert int(sample.target_group[position]) == int(sample.source_group[k])  # a token of its own group


@pytest.fixture(scope="module")
def ids_module(gemma_b):
    return TokenIdentity("ids", target_embedding(gemma_b.model), None)


def test_stage1_with_aligned_ids_equals_lstsq_on_the_design_with_target_embeddings(samples_ab, llama_a, gemma_b,
                                                                                   ids_module):
    src, tgt = llama_a, gemma_b
    candidates = candidate_layers(src.layout, tgt.layout, "depth", 1)
    d_tok = ids_module.width
    stats = accumulate_cross(empty_stats(src.layout, tgt.layout, candidates, token_width=d_tok), src, tgt, samples_ab,
                             "pre_norm", token_identity=ids_module)
    translator = solve_translator(stats, {"keys": candidates, "values": candidates}, src.layout, tgt.layout,
                                  "pre_norm", ridge=0.0, token_identity="ids")
    x_rows, y_rows = {}, {}  # (name, layer) → row blocks
    for sample in samples_ab:
        xs = capture(src.model, src.layout, sample.source_ids, "pre_norm").objects
        ys = capture(tgt.model, tgt.layout, sample.target_ids, "pre_norm").objects
        e = _embedding_rows(tgt, sample.target_ids[sample.positions])
        tg = sample.target_group.tolist()
        for name in ("keys", "values"):
            for t, (s,) in candidates.items():
                x_rows.setdefault((name, t), []).append(torch.cat([xs[name][s][sample.translated].double(), e], -1))
                means = [torch.stack([ys[name][t][j].double() for j in range(len(tg)) if tg[j] == g]).mean(0)
                         for g in sample.source_group.tolist()]
                y_rows.setdefault((name, t), []).append(torch.stack(means))
    for (name, t), blocks in x_rows.items():
        x, y = torch.cat(blocks), torch.cat(y_rows[(name, t)])
        assert x.shape[1] == src.layout.kv_width + d_tok
        reference = torch.linalg.lstsq(x, y, driver="gelsd").solution  # [d_in, d_tgt], minimum norm
        weight = translator.weight(name, t).detach().double()  # [d_tgt, d_in]
        # Predictions, not weights: the design need not have full column rank (few distinct ids).
        torch.testing.assert_close(x @ weight.T, x @ reference, atol=1e-4 * y.abs().max().item(), rtol=1e-4)


def test_translated_tensors_read_the_aligned_target_ids(samples_ab, llama_a, gemma_b, ids_module):
    src, tgt = llama_a, gemma_b
    candidates = candidate_layers(src.layout, tgt.layout, "depth", 1)
    stats = accumulate_cross(empty_stats(src.layout, tgt.layout, candidates, token_width=ids_module.width), src, tgt,
                             samples_ab, "pre_norm", token_identity=ids_module)
    translator = solve_translator(stats, {"keys": candidates, "values": candidates}, src.layout, tgt.layout,
                                  "pre_norm", ridge=1e-3, token_identity="ids")
    translator.token_module = ids_module
    sample = samples_ab[0]
    cap = source_capture(src, sample, "pre_norm")
    with torch.no_grad():
        got = translated_tensors(translator, cap, sample)
    e = _embedding_rows(tgt, sample.target_ids[sample.positions])
    for name in ("keys", "values"):
        for t, (s,) in candidates.items():
            x = torch.cat([cap.objects[name][s][sample.translated].double(), e], -1)
            want = x @ translator.weight(name, t).detach().double().T
            torch.testing.assert_close(got[name][t].double(), want, atol=1e-5, rtol=1e-5)
    # The ids matter: the same rows with the ids rolled by one translate differently.
    rolled = translator.translate_objects({n: [x[sample.translated] for x in xs] for n, xs in cap.objects.items()},
                                          aligned_token_ids(sample).roll(1))
    assert not torch.allclose(rolled["keys"][0], got["keys"][0])


def test_the_codebook_is_refused_across_tokenizers(samples_ab, llama_a, gemma_b):
    candidates = candidate_layers(llama_a.layout, gemma_b.layout, "depth", 1)
    codebook = make_token_identity("codebook", llama_a.model, llama_a.layout, gemma_b.model, "pre_norm")
    stats = empty_stats(llama_a.layout, gemma_b.layout, candidates, token_width=codebook.width)
    with pytest.raises(ConfigError, match="use --token-identity ids"):
        accumulate_samples(stats, llama_a, gemma_b, samples_ab, "pre_norm", token_identity=codebook)
