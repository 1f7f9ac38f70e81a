"""Unit tests of the embedded MLA/DSA family's derivation, on tiny random-init models built from configs.

The conversion is checked against the source's own logits where it must be exact (one KV head and norms that
only rescale by a constant), the RoRoPE split and the DSA transfer against their algebraic invariants, and the
indexer's differentiable scores against transformers' own indexer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from infra import mla_models, tiny_models
from infra.mla_models import (
    DSASpec,
    convert_mla_to_dsa,
    convert_qwen3_to_mla,
    index_scores,
    interleave_order,
    recipe_hash,
    rorope_directions,
    spec_for,
    split_keys_rorope,
)
from tiny_configs import tiny_model
from translators.errors import ConfigError


def _rows(vocab: int, rows: int = 4, length: int = 24, seed: int = 0) -> dict:
    """Random packed rows as :func:`infra.mla_models._rows` makes them: one conversation per row."""
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (rows, length), generator=gen),
            "position_ids": torch.arange(length).repeat(rows, 1),
            "weights": torch.ones(rows, length), "conv_start": torch.zeros(rows, length, dtype=torch.long)}


def _scaled_orthogonal(rows: int, cols: int, scale: float) -> torch.Tensor:
    """(rows, cols) with orthonormal columns (rows >= cols) times ``scale``."""
    q, _ = torch.linalg.qr(torch.randn(rows, cols, dtype=torch.float64))
    return (q * scale).float()


def _isometric_qwen3(heads: int = 2, layers: int = 2) -> Qwen3ForCausalLM:
    """A Qwen3 with one KV head whose per-head q/k norms and the MLA latent norm act as constant scales.

    hidden = head_dim = 32 and the input RMSNorm gains are 1, so the attention input has RMS 1; every q/k/v
    projection (and each head's o_proj block) is a scaled orthogonal matrix, so q_norm/k_norm see inputs of
    constant RMS and the latent (an orthogonal image of the values) has constant RMS too. The q/k norm gains
    and everything outside attention are random.
    """
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=1, head_dim=32, initializer_range=0.3,
                         max_position_embeddings=64, rms_norm_eps=1e-12, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(torch.cat([_scaled_orthogonal(32, 32, 0.7) for _ in range(heads)]))
            attn.k_proj.weight.copy_(_scaled_orthogonal(32, 32, 1.3))
            attn.v_proj.weight.copy_(_scaled_orthogonal(32, 32, 0.9))
            attn.o_proj.weight.copy_(torch.cat([_scaled_orthogonal(32, 32, 0.5) for _ in range(heads)], dim=1))
            attn.q_norm.weight.uniform_(0.5, 2.0)
            attn.k_norm.weight.uniform_(0.5, 2.0)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def test_conversion_is_exact_when_norms_only_rescale():
    source = _isometric_qwen3()
    rows = _rows(source.config.vocab_size)
    mla, diagnostics = convert_qwen3_to_mla(source, rows, kv_lora_rank=32, ridge=1e-12)
    assert all(d["rope_energy"] == pytest.approx(1.0) for d in diagnostics)  # one KV head: all in k_pe
    test = _rows(source.config.vocab_size, rows=2, length=40, seed=1)
    with torch.no_grad():
        want = source(input_ids=test["input_ids"]).logits
        got = mla(input_ids=test["input_ids"]).logits
    assert want.abs().max() > 1.0  # the comparison is not trivially small
    assert torch.allclose(got, want, atol=2e-4, rtol=0), (got - want).abs().max()


def test_everything_outside_attention_is_copied_exactly():
    source = tiny_model("qwen3", seed=3)  # 2 KV heads, untied lm_head, random weights
    with torch.no_grad():
        for p in source.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)  # norm gains that differ from the target's initial ones
    mla, _ = convert_qwen3_to_mla(source, _rows(source.config.vocab_size), kv_lora_rank=24)
    assert mla.config.first_k_dense_replace == mla.config.num_hidden_layers
    want = source.state_dict()
    got = mla.state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(source.config.num_hidden_layers):
        names += [f"model.layers.{i}.{part}.weight" for part in (
            "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "self_attn.o_proj")]
    for name in names:
        assert torch.equal(got[name], want[name]), name


def test_conversion_beats_an_unconverted_mla_model():
    source = tiny_model("qwen3", seed=4)
    rows = _rows(source.config.vocab_size, rows=6, length=32)
    mla, _ = convert_qwen3_to_mla(source, rows, kv_lora_rank=48)
    torch.manual_seed(0)
    random_mla = type(mla)(mla.config).float().eval()
    mla_models.copy_outside_attention(source, random_mla)
    held_out = _rows(source.config.vocab_size, rows=2, length=32, seed=5)
    converted = mla_models.mean_kl(source, mla, held_out)
    baseline = mla_models.mean_kl(source, random_mla, held_out)
    assert converted < 0.5 * baseline, (converted, baseline)


def test_tied_embeddings_stay_tied():
    source = _isometric_qwen3(layers=1)
    source.config.tie_word_embeddings = True
    mla, _ = convert_qwen3_to_mla(source, _rows(61), kv_lora_rank=16)
    assert mla.config.tie_word_embeddings
    assert mla.lm_head.weight.data_ptr() == mla.model.embed_tokens.weight.data_ptr()


def test_rorope_split_puts_proportional_heads_into_the_rotary_key():
    torch.manual_seed(0)
    n, hd = 200, 8
    base = torch.randn(n, 1, hd, dtype=torch.float64)
    keys = torch.cat([base, -2.0 * base, 0.5 * base], dim=1)  # (n, G=3, hd): proportional heads
    u, captured = rorope_directions(keys, hd)
    assert torch.allclose(captured, torch.ones(hd // 2, dtype=torch.float64))
    w_k = torch.cat([torch.eye(hd), -2.0 * torch.eye(hd), 0.5 * torch.eye(hd)]).double()  # keys = w_k @ base
    w_rope, w_res = split_keys_rorope(w_k, u, hd)
    assert w_res.abs().max() < 1e-10


def test_rorope_residual_is_orthogonal_to_the_shared_direction():
    torch.manual_seed(1)
    hd, groups = 8, 3
    keys = torch.randn(300, groups, hd, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.3]).view(1, -1, 1).double()
    u, captured = rorope_directions(keys, hd)
    assert (captured >= 1 / groups).all() and (captured <= 1).all()
    w_k = torch.randn(groups * hd, 5, dtype=torch.float64)
    w_rope, w_res = split_keys_rorope(w_k, u, hd)
    res = w_res.view(groups, hd, 5)
    weight = torch.cat([u, u]).T  # (G, hd)
    assert torch.allclose((weight.unsqueeze(-1) * res).sum(0), torch.zeros(hd, 5, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(weight.unsqueeze(-1) * w_rope + res, w_k.view(groups, hd, 5))


def test_interleave_order_pairs_half_split_dims():
    assert interleave_order(8) == [0, 4, 1, 5, 2, 6, 3, 7]


def _converted_dsa(topk: int):
    source = tiny_model("qwen3", seed=6, rms_norm_eps=1e-12)  # diag(1/g) is exact up to the norms' epsilon
    mla, _ = convert_qwen3_to_mla(source, _rows(source.config.vocab_size), kv_lora_rank=32)
    return mla, convert_mla_to_dsa(mla, DSASpec(parent="x", index_topk=topk, index_n_heads=2, index_head_dim=24))


def test_dsa_equals_mla_when_the_indexer_keeps_every_token(tmp_path):
    mla, dsa = _converted_dsa(topk=64)
    ids = _rows(mla.config.vocab_size, rows=2, length=20, seed=2)["input_ids"]
    with torch.no_grad():
        want = mla(input_ids=ids).logits
        got = dsa(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    dsa.save_pretrained(tmp_path)  # safetensors round trip, then generation with the indexed cache
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DeepseekV32ForCausalLM"
    out = loaded.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 24)


def test_sparse_dsa_differs_from_dense_mla():
    mla, dsa = _converted_dsa(topk=4)
    ids = _rows(mla.config.vocab_size, rows=1, length=20, seed=3)["input_ids"]
    with torch.no_grad():
        dense, sparse = mla(input_ids=ids).logits, dsa(input_ids=ids).logits
    assert torch.allclose(sparse[:, :4], dense[:, :4], atol=1e-4)  # the first 4 queries see at most 4 keys
    assert (sparse[:, 8:] - dense[:, 8:]).abs().max() > 1e-3


def test_differentiable_index_scores_pick_the_indexers_tokens():
    _, dsa = _converted_dsa(topk=5)
    torch.manual_seed(0)
    hidden = torch.randn(2, 12, dsa.config.hidden_size)
    attn = dsa.model.layers[0].self_attn
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    positions = torch.arange(12).repeat(2, 1)
    cos, sin = dsa.model.rotary_emb(hidden, positions)
    causal = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 12, 12)
    want = attn.indexer(hidden, q_resid, (cos, sin), causal, positions)
    scores = index_scores(attn.indexer, hidden, q_resid, cos, sin).masked_fill(~causal, float("-inf"))
    got = scores.topk(5, dim=-1).indices
    assert torch.equal(got.sort(-1).values[:, 5:], want.long().sort(-1).values[:, 5:])  # rows with > 5 keys


def test_indexer_warm_up_lowers_its_kl():
    mla, dsa = _converted_dsa(topk=4)
    mla.set_attn_implementation("eager")
    spec = DSASpec(parent="x", index_topk=4, steps=30, batch_size=2, lr=3e-2)
    batch = _rows(mla.config.vocab_size, rows=2, length=16)
    rows = {key: value.repeat(30, 1) for key, value in batch.items()}  # one batch, fitted 30 times
    teacher = mla_models._DenseTeacher(mla)
    try:
        before = mla_models.indexer_quality(dsa, teacher, batch, topk=4)
        mla_models.warm_up_indexers(dsa, teacher, rows, spec, progress=False)
        after = mla_models.indexer_quality(dsa, teacher, batch, topk=4)
    finally:
        teacher.close()
    assert after["indexer_kl"] < 0.5 * before["indexer_kl"], (before, after)
    assert after["indexer_recall"] > before["indexer_recall"]
    assert not any(p.requires_grad for p in dsa.parameters())


def test_recipe_hash_follows_the_parent(monkeypatch):
    before = {name: recipe_hash(name) for name in mla_models.MLA_MODELS}
    changed = dataclasses.replace(tiny_models.TINY_MODELS["kvlingo-tiny-s"], seed=99)
    monkeypatch.setitem(tiny_models.TINY_MODELS, "kvlingo-tiny-s", changed)
    after = {name: recipe_hash(name) for name in mla_models.MLA_MODELS}
    assert after["kvlingo-tiny-s-mla"] != before["kvlingo-tiny-s-mla"]
    assert after["kvlingo-tiny-s-dsa"] != before["kvlingo-tiny-s-dsa"]  # through its MLA parent
    monkeypatch.setitem(tiny_models.TINY_MODELS, "kvlingo-tiny-s", tiny_models.TINY_MODELS["kvlingo-tiny-s"])
    mla_spec = dataclasses.replace(mla_models.MLA_MODELS["kvlingo-tiny-s-mla"], kv_lora_rank=32)
    monkeypatch.setitem(mla_models.MLA_MODELS, "kvlingo-tiny-s-mla", mla_spec)
    assert recipe_hash("kvlingo-tiny-s-dsa") not in (before["kvlingo-tiny-s-dsa"], after["kvlingo-tiny-s-dsa"])


def test_unknown_names_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'kvlingo-tiny-s-mla'"):
        spec_for("kvlingo-tiny-s-mal")
    with pytest.raises(ConfigError, match="Unknown embedded MLA model"):
        mla_models.ensure_mla_model("kvlingo-tiny-x-mla", home=tmp_path)
    assert not (tmp_path / "models").exists()  # nothing built or locked for a bad name


def test_family_is_registered_in_the_zoo_and_the_tiny_dispatch(monkeypatch, tmp_path):
    from infra.zoo import resolve_model

    for name in mla_models.MLA_MODELS:
        spec = resolve_model(name)
        assert (spec.source, spec.location) == ("embedded", name)
    calls = []
    monkeypatch.setattr(mla_models, "ensure_mla_model", lambda name, **kw: calls.append(name) or tmp_path)
    assert tiny_models.ensure_tiny_model("kvlingo-tiny-s-dsa", home=tmp_path) == tmp_path
    assert calls == ["kvlingo-tiny-s-dsa"]


def test_rank_and_rope_checks():
    source = tiny_model("qwen3", seed=7)  # 2 KV heads of 16: NoPE keys + values have rank (2*2 - 1) * 16 = 48
    with pytest.raises(ConfigError, match="kv_lora_rank 49"):
        convert_qwen3_to_mla(source, _rows(source.config.vocab_size), kv_lora_rank=49)
    source.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="full default RoPE"):
        mla_models.mla_config(source.config, 16)
