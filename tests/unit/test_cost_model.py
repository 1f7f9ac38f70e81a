"""The cost model of `kvlingo plan` (tasks/cost_model.py) against hand calculations and kvlingo's own statistics."""

import json

import pytest

from tasks.cost_model import (ModelShape, Throughput, Workload, candidate_sets, capture_flops_per_token, estimate, fit_nu,
                              gram_counts, gram_flops_per_token, map_params, stats_bytes)
from translators.errors import ConfigError

SMALL = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
         "intermediate_size": 16, "vocab_size": 10}

# Public config.json values (sizes only) of two hub models, as `--configs DIR` would hold them.
QWEN3 = {
    "Qwen/Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28, "hidden_size": 1024,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                        "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen3-1.7B": {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28, "hidden_size": 2048,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                        "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True},
}


def test_shape_and_forward_flops_by_hand():
    m = ModelShape.from_config("small", SMALL)
    # q 8·8 + k,v 2·8·4 + o 8·8 + gated MLP 3·8·16
    assert m.layer_params == 64 + 64 + 64 + 384 == 576
    assert m.kv_width == 4 and m.decoder_params == 1152 and m.head_params == 80
    # context 3: a query reads (3+1)/2 = 2 keys on average; 4·h·d_head·2 = 64 per layer, 2 layers
    assert m.attention_flops_per_token(3) == 128
    assert m.forward_flops_per_token(3) == 2 * 1152 + 128
    assert capture_flops_per_token(m, 3) == pytest.approx(2432 + 2 * 80 / 3)


def test_sliding_window_mean_keys_by_hand():
    m = ModelShape.from_config("slide", {**SMALL, "layer_types": ["sliding_attention", "full_attention"],
                                         "sliding_window": 2})
    # 4 tokens, window 2: positions read 1, 2, 2, 2 keys → 7/4; the global layer reads (4+1)/2
    assert m.mean_keys_read(4, 0) == pytest.approx(7 / 4)
    assert m.mean_keys_read(4, 1) == pytest.approx(5 / 2)
    assert m.sliding_window == 2


def test_gram_flops_and_bytes_by_hand():
    m = ModelShape.from_config("small", SMALL)
    cands = candidate_sets(m, m, "depth", 1)
    assert cands == {0: (0,), 1: (1,)}
    assert gram_counts(cands) == {"xx": 2, "xy": 2, "yy": 2}
    # per object: xx 2·4²·2 + xy 2·4·4·2 + yy 2·4·2 = 144; keys and values
    assert gram_flops_per_token(m, m, cands) == 288
    assert stats_bytes(m, m, cands) == 2 * 8 * (16 * 2 + 16 * 2 + 2) == 1056
    # r2 reads every source layer per target: pairs (0,0) (0,1) (1,1), four (s, t) maps
    assert gram_counts(candidate_sets(m, m, "r2", 1)) == {"xx": 3, "xy": 4, "yy": 2}
    assert map_params(m, m, nu=2) == 2 * 2 * 2 * 4 * 4


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama"])
def test_bytes_and_candidates_match_kvlingo_statistics(family):
    """The cost model's candidate sets and fp64 bytes equal what stage 1 actually allocates."""
    from tiny_configs import tiny_config, tiny_model
    from translators.layout import cache_layout
    from translators.stage1 import candidate_layers, default_nu, empty_stats

    src_model, tgt_model = tiny_model(family), tiny_model(family, seed=1, hidden_size=48)
    src_layout, tgt_layout = cache_layout(src_model), cache_layout(tgt_model)
    src, tgt = (ModelShape.from_config(family, m.config.to_dict()) for m in (src_model, tgt_model))
    for assignment in ("r2", "depth"):
        cands = candidate_layers(src_layout, tgt_layout, assignment, 1)
        assert candidate_sets(src, tgt, assignment, 1) == cands
        stats = empty_stats(src_layout, tgt_layout, cands)
        allocated = sum(t.numel() * t.element_size() for s in stats.values() for part in (s.xx, s.xy, s.yy)
                        for t in part.values())
        assert stats_bytes(src, tgt, cands) == allocated
    assert tiny_config(family).num_hidden_layers == src.n_layers
    # `kvlingo plan` without --nu costs the ν `kvlingo fit` uses without --nu.
    assert fit_nu(src, tgt, None) == default_nu(src_layout, tgt_layout) == min(2, min(map(len, candidate_sets(src, tgt, "r2", 1).values())))
    assert fit_nu(src, tgt, 1) == 1


def test_estimate_wall_time_by_hand():
    m = ModelShape.from_config("small", SMALL)
    tp = Throughput(bf16_tflops=1e-9, fp64_tflops=1e-9, mfu=1.0, gram_efficiency=1.0, merge_gb_s=1e-6,
                    allreduce_gb_s=1e-6)  # 1000 FLOP/s, 1000 B/s: seconds are FLOPs / 1000
    w = Workload(tokens=30, prefix_tokens=3, continuation_tokens=2, assignment="depth", nu=1, steps=2, batch=4, shard_samples=4,
                 token_identity=False)
    e = estimate(m, m, w, gpus=2, throughput=tp)
    cap = capture_flops_per_token(m, 3)
    assert e.stage1_flops["capture"] == pytest.approx(30 * 2 * cap)
    assert e.seconds["stage1_capture"] == pytest.approx(30 * 2 * cap / 2 / 1000)
    assert e.seconds["stage1_gram"] == pytest.approx(30 * 288 / 2 / 1000)
    # 10 conversations → 3 shards; a worker merges ⌈3/2⌉ = 2, the driver 1 more; each reads and writes 1056 B
    assert e.shards == 3 and e.merge_bytes_per_shard == 2112
    assert e.seconds["stage1_merge"] == pytest.approx(3 * 2112 / 1000)
    # stage 2: a conversation = capture 3·2432 + translate 2·2 layers·2·4·4·(3-1) + student + teacher head + backward
    student = 2 * 2 * 1152 + 2 * sum(4 * 2 * 4 * (2 + 1.5) for _ in range(2)) + 2 * 2 * 80
    translate = 2 * 2 * 2 * 16 * 2
    sample = 3 * 2432 + translate + student + 2 * 2 * 80 + 2 * student + 2 * translate
    assert e.stage2_step_flops == pytest.approx(4 * sample)
    assert e.seconds["stage2"] == pytest.approx(2 * (4 * sample / 2 / 1000 + 2 * 4 * e.map_params / 1000))
    assert e.seconds["total"] == pytest.approx(e.seconds["stage1"] + e.seconds["stage2"])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_token_identity_widens_the_statistics_as_kvlingo_allocates_them(family):
    """With token identity every source layer's features gain the target's embedding: the cost model's bytes equal
    stage 1's allocation with that token width, and its default follows the vocabularies."""
    from tiny_configs import tiny_model
    from translators.layout import cache_layout
    from translators.stage1 import candidate_layers, empty_stats

    src_model, tgt_model = tiny_model(family), tiny_model(family, seed=1, hidden_size=48)
    src, tgt = (ModelShape.from_config(family, m.config.to_dict()) for m in (src_model, tgt_model))
    cands = candidate_layers(cache_layout(src_model), cache_layout(tgt_model), "r2", 2)
    stats = empty_stats(cache_layout(src_model), cache_layout(tgt_model), cands, token_width=48)
    allocated = sum(s.nbytes for s in stats.values())
    assert stats_bytes(src, tgt, cands, token_width=48) == allocated > stats_bytes(src, tgt, cands)
    on = estimate(src, tgt, Workload(tokens=1000), gpus=1)  # equal vocabularies: on, as kvlingo fit's auto
    off = estimate(src, tgt, Workload(tokens=1000, token_identity=False), gpus=1)
    assert on.workload["token_identity"] and not off.workload["token_identity"]
    assert on.stats_bytes == allocated and on.map_params == map_params(src, tgt, 2, token_width=48)
    ds, dt = src.kv_width, tgt.kv_width
    assert on.map_params / off.map_params == pytest.approx((ds + 48) / ds) and dt
    other = ModelShape.from_config("other", {**tgt_model.config.to_dict(), "vocab_size": src.vocab + 1})
    assert not estimate(src, other, Workload(tokens=1000), gpus=1).workload["token_identity"]


def test_bad_inputs_are_config_errors():
    m = ModelShape.from_config("small", SMALL)
    with pytest.raises(ConfigError, match="gpus"):
        estimate(m, m, Workload(tokens=10), gpus=0)
    with pytest.raises(ConfigError, match="tokens"):
        Workload(tokens=0)
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelShape.from_config("broken", {"num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="mfu"):
        Throughput(mfu=1.5)
    with pytest.raises(ConfigError, match="MLA config.*GQA configs only"):
        ModelShape.from_config("mla", {**SMALL, "kv_lora_rank": 4, "qk_rope_head_dim": 2})


def test_plan_cli_reads_hub_configs_from_a_folder(tmp_path, monkeypatch):
    """`kvlingo plan` for two hub ids offline, from --configs (no weights); the JSON holds the table's numbers."""
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for repo, config in QWEN3.items():
        (tmp_path / repo).mkdir(parents=True)
        (tmp_path / repo / "config.json").write_text(json.dumps(config))
    out = CliRunner().invoke(app, ["plan", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "--tokens", "500000", "--gpus", "8",
                                   "--configs", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    assert r["kv_width"] == {"source": 1024, "target": 1024}
    # r2: all 28·29/2 source pairs and 28·28 maps per object; fp64
    assert r["candidates"] == {"xx": 406, "xy": 784, "yy": 28}
    # One tokenizer (151,936 entries both): token identity is on, as in kvlingo fit; each source layer's features
    # gain the target's 2048-wide embedding, whose sums are kept once: 2048 x (28 source layers x 1024 + 2048 +
    # 28 target layers x 1024) more entries per object.
    assert r["workload"]["token_identity"]
    assert r["stats_bytes"] == 2 * 8 * (1024**2 * 406 + 1024**2 * 784 + 28 + 2048 * (28 * 1024 + 2048 + 28 * 1024))
    assert r["map_params"] == 2 * 28 * 2 * (1024 + 2048) * 1024  # ν = 2 reads of [K/V | embedding] per map
    out = CliRunner().invoke(app, ["plan", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "--tokens", "500000", "--gpus", "8",
                                   "--configs", str(tmp_path), "--no-token-identity", "--json"])
    r = json.loads(out.stdout)
    assert r["stats_bytes"] == 2 * 8 * (1024**2 * 406 + 1024**2 * 784 + 28)
    assert r["gram_flops_per_token"] == 2 * (2 * 1024**2 * 406 + 2 * 1024**2 * 784 + 2 * 1024 * 28)
    assert r["seconds"]["total"] > 0 and r["gpus"] == 8
    table = CliRunner().invoke(app, ["plan", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "--configs", str(tmp_path)])
    assert table.exit_code == 0 and "Gram fp64" in table.stdout


def test_plan_cli_hub_id_without_config_fails_clearly(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    out = CliRunner().invoke(app, ["plan", "nobody/model-a", "nobody/model-b", "--configs", str(tmp_path)])
    assert out.exit_code == 2
    assert "no config.json for nobody/model-a" in out.output and "--configs" in out.output
    assert "source:" in out.output and "target:" in out.output
