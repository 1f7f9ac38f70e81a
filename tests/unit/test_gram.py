"""GramStats: streaming fp64 sums checked against explicit numpy computations."""

import numpy as np
import pytest
import torch

from translators.errors import ConfigError, NonFiniteError, PairMismatchError
from translators.gram import GramStats

N_SRC, N_TGT, D_SRC, D_TGT = 4, 3, 5, 3
CANDS = {0: (0, 1), 1: (1, 3), 2: (2,)}


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(n, D_SRC, generator=g) for _ in range(N_SRC)]
    tgt = [torch.randn(n, D_TGT, generator=g) for _ in range(N_TGT)]
    return src, tgt


def _np(t):
    return t.double().numpy()


def test_empty_allocates_only_cooccurring_pairs():
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    assert set(st.xx) == {(0, 0), (0, 1), (1, 1), (1, 3), (3, 3), (2, 2)}
    assert set(st.xy) == {(0, 0), (1, 0), (1, 1), (3, 1), (2, 2)}
    assert set(st.yy) == {0, 1, 2}
    assert all(v.dtype == torch.float64 for v in st.xx.values())


@pytest.mark.parametrize("cands", [{}, {0: ()}, {0: (-1,)}, {-2: (0,)}, {0: (1, 1)}])
def test_empty_rejects_bad_candidates(cands):
    with pytest.raises(ConfigError):
        GramStats.empty("keys", cands, D_SRC, D_TGT)


def test_empty_rejects_unknown_side():
    with pytest.raises(ConfigError):
        GramStats.empty("queries", CANDS, D_SRC, D_TGT)


def test_unweighted_sums_match_numpy():
    src, tgt = _data(40, 0)
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    st.accumulate(src, tgt)
    np.testing.assert_allclose(st.xx[(1, 3)].numpy(), _np(src[1]).T @ _np(src[3]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.xy[(3, 1)].numpy(), _np(src[3]).T @ _np(tgt[1]), rtol=1e-12, atol=1e-12)
    assert float(st.yy[2]) == pytest.approx(float((_np(tgt[2]) ** 2).sum()), rel=1e-12)
    assert st.weight_sum == 40.0 and st.n_tokens == 40


def test_weighted_sums_match_numpy():
    src, tgt = _data(30, 1)
    w = torch.rand(30, generator=torch.Generator().manual_seed(2))
    st = GramStats.empty("values", CANDS, D_SRC, D_TGT)
    st.accumulate(src, tgt, weights=w)
    W = np.diag(_np(w))
    np.testing.assert_allclose(st.xx[(0, 1)].numpy(), _np(src[0]).T @ W @ _np(src[1]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.xx[(1, 1)].numpy(), _np(src[1]).T @ W @ _np(src[1]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.xy[(1, 0)].numpy(), _np(src[1]).T @ W @ _np(tgt[0]), rtol=1e-12, atol=1e-12)
    assert float(st.yy[1]) == pytest.approx(float(np.trace(_np(tgt[1]).T @ W @ _np(tgt[1]))), rel=1e-12)
    assert st.weight_sum == pytest.approx(float(_np(w).sum()), rel=1e-12)
    assert st.n_tokens == 30


def test_merged_chunks_equal_one_pass():
    src, tgt = _data(90, 3)
    one = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    one.accumulate(src, tgt)
    parts = []
    for lo in (0, 25, 60):
        hi = {0: 25, 25: 60, 60: 90}[lo]
        p = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
        p.accumulate([x[lo:hi] for x in src], [y[lo:hi] for y in tgt])
        parts.append(p)
    merged = parts[0] + parts[1] + parts[2]
    # fp64 sums of the same 90 products in another order: the reordering error is ≲ 90·2⁻⁵³ ≈ 1e-14 relative;
    # 1e-12 leaves two orders of magnitude for BLAS kernels that block the sums differently.
    for k in one.xx:
        torch.testing.assert_close(merged.xx[k], one.xx[k], rtol=1e-12, atol=1e-12)
    for k in one.xy:
        torch.testing.assert_close(merged.xy[k], one.xy[k], rtol=1e-12, atol=1e-12)
    for k in one.yy:
        torch.testing.assert_close(merged.yy[k], one.yy[k], rtol=1e-12, atol=1e-12)
    assert merged.n_tokens == 90 and merged.weight_sum == 90.0
    # merge must not mutate its inputs
    assert parts[0].n_tokens == 25


def test_memory_does_not_grow_with_samples():
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)

    def numel():
        return sum(v.numel() for d in (st.xx, st.xy, st.yy) for v in d.values())

    before = numel()
    for seed in range(3):
        st.accumulate(*_data(50, seed))
    assert numel() == before


def test_block_gram_and_cross_match_concatenated_design():
    src, tgt = _data(20, 4)
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    st.accumulate(src, tgt)
    X = np.concatenate([_np(src[3]), _np(src[1])], axis=1)  # order (3, 1) exercises the transpose
    np.testing.assert_allclose(st.block_gram([3, 1]).numpy(), X.T @ X, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.block_cross([3, 1], 1).numpy(), X.T @ _np(tgt[1]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError):
        st.block_gram([0, 3])  # never co-occur
    with pytest.raises(ConfigError):
        st.block_cross([2], 0)  # not a candidate of target 0


def test_save_load_round_trip_is_bit_exact(tmp_path):
    src, tgt = _data(25, 5)
    st = GramStats.empty("values", CANDS, D_SRC, D_TGT)
    st.accumulate(src, tgt, weights=torch.rand(25) * 0.7)
    path = tmp_path / "g.safetensors"
    st.save(path)
    back = GramStats.load(path)
    assert back.side == st.side and back.candidates == st.candidates
    assert back.weight_sum == st.weight_sum and back.n_tokens == st.n_tokens
    for name in ("xx", "xy", "yy"):
        a, b = getattr(st, name), getattr(back, name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(PairMismatchError):
        GramStats.load(path)


def test_merge_mismatches_raise():
    keys = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    with pytest.raises(PairMismatchError):
        keys.merge(GramStats.empty("values", CANDS, D_SRC, D_TGT))
    with pytest.raises(PairMismatchError):
        keys.merge(GramStats.empty("keys", {0: (0, 1)}, D_SRC, D_TGT))
    with pytest.raises(PairMismatchError):
        keys.merge(GramStats.empty("keys", CANDS, D_SRC + 1, D_TGT))


def test_nan_input_names_the_layer():
    src, tgt = _data(10, 6)
    src[3][4, 2] = float("nan")
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    with pytest.raises(NonFiniteError, match=r"source layer 3 keys"):
        st.accumulate(src, tgt)
    src, tgt = _data(10, 6)
    tgt[2][0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"target layer 2"):
        st.accumulate(src, tgt)


def test_shape_and_weight_errors():
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    src, tgt = _data(10, 7)
    with pytest.raises(ConfigError):
        st.accumulate(src[:3], tgt)  # layer 3 missing
    bad = list(src)
    bad[1] = bad[1][:9]
    with pytest.raises(ConfigError):
        st.accumulate(bad, tgt)  # position counts differ
    bad = list(src)
    bad[0] = torch.randn(10, D_SRC + 1)
    with pytest.raises(ConfigError):
        st.accumulate(bad, tgt)
    with pytest.raises(ConfigError):
        st.accumulate(src, tgt, weights=-torch.ones(10))
    with pytest.raises(ConfigError):
        st.accumulate(src, tgt, weights=torch.ones(9))
    assert st.n_tokens == 0  # failed calls leave the sums untouched


def test_token_features_are_kept_once_and_assemble_the_concatenated_design(tmp_path):
    """With token identity each source layer's features are [x_s | e]: the blocks equal numpy's on that design
    (weighted, ν = 2 in both orders), merging shards equals one pass, save/load keeps the token sums, and the
    statistics hold e's sums once (not once per source layer)."""
    d_tok, n = 4, 30
    src, tgt = _data(n, 6)
    g = torch.Generator().manual_seed(7)
    e, w = torch.randn(n, d_tok, generator=g), torch.rand(n, generator=g)
    st = GramStats.empty("keys", CANDS, D_SRC, D_TGT, d_tok=d_tok)
    assert (st.d_tok, st.d_in) == (d_tok, D_SRC + d_tok)
    st.accumulate(src, tgt, weights=w, tokens=e)
    wide = [torch.cat([x, e], dim=1) for x in src]
    W = np.diag(_np(w))
    X = np.concatenate([_np(wide[3]), _np(wide[1])], axis=1)
    np.testing.assert_allclose(st.block_gram([3, 1]).numpy(), X.T @ W @ X, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.block_cross([3, 1], 1).numpy(), X.T @ W @ _np(tgt[1]), rtol=1e-12, atol=1e-12)
    concatenated = GramStats.empty("keys", CANDS, D_SRC + d_tok, D_TGT)
    concatenated.accumulate(wide, tgt, weights=w)
    assert st.nbytes < concatenated.nbytes
    parts = [GramStats.empty("keys", CANDS, D_SRC, D_TGT, d_tok=d_tok) for _ in range(2)]
    for part, rows in zip(parts, (slice(0, 12), slice(12, n))):
        part.accumulate([x[rows] for x in src], [y[rows] for y in tgt], weights=w[rows], tokens=e[rows])
    merged = parts[0] + parts[1]
    torch.testing.assert_close(merged.block_gram([0, 1]), st.block_gram([0, 1]), rtol=1e-12, atol=1e-12)
    st.save(tmp_path / "t.safetensors")
    back = GramStats.load(tmp_path / "t.safetensors")
    assert torch.equal(back.block_gram([1, 3]), st.block_gram([1, 3])) and torch.equal(back.ee, st.ee)
    with pytest.raises(ConfigError, match="pass tokens exactly when they do"):
        st.accumulate(src, tgt)
    with pytest.raises(PairMismatchError, match="d_tok"):
        st.merge(GramStats.empty("keys", CANDS, D_SRC, D_TGT))


def test_fit_merges_shards_one_at_a_time_to_the_one_pass_sums():
    """tasks.fit.merge_stats folds a generator of shards: equal to one pass, and an early shard is freed before the
    next ones are read (a 1024-conversation SmolLM2 → Gemma-3 fit ran out of 24 GB holding every shard)."""
    import gc
    import weakref

    from tasks.fit import merge_stats

    chunks = [_data(10, seed) for seed in range(4)]
    one_pass = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
    for src, tgt in chunks:
        one_pass.accumulate(src, tgt)
    alive_when_read: list[bool] = []
    first: list[weakref.ref] = []

    def shards():
        for k, (src, tgt) in enumerate(chunks):
            if k >= 2:
                gc.collect()
                alive_when_read.append(first[0]() is not None)
            part = GramStats.empty("keys", CANDS, D_SRC, D_TGT)
            part.accumulate(src, tgt)
            if k == 0:
                first.append(weakref.ref(part))
            yield {"keys": part}
            del part

    merged = merge_stats(shards())["keys"]
    for key, value in one_pass.xx.items():
        torch.testing.assert_close(merged.xx[key], value, rtol=1e-12, atol=1e-12)
    assert merged.n_tokens == one_pass.n_tokens == 40
    assert alive_when_read == [False, False]
    with pytest.raises(ConfigError, match="no statistics to merge"):
        merge_stats(iter([]))
