"""The calibrated quality floor (translators/quality.py): attention-output cosine per layer on tiny random-init models
of every family, checked against a hand-written softmax(QK^T)V; the buckets, the floor and the gate's verdict at
their edges; the record in the manifests of a tiny fit."""

import json
import math

import pytest
import torch
import yaml
from tiny_configs import FAMILIES, noisy_identity, save_tiny_model_dir, tiny_model, tiny_tokenizer, words
from typer.testing import CliRunner

from translators.capture import capture
from translators.errors import ConfigError
from translators.layout import cache_layout
from translators.quality import (
    SampleQuality,
    bucket_of,
    calibrate_floor,
    measure,
    native_reference,
    quality_record,
    quality_verdict,
    record_quality,
    sample_quality,
)
from translators.stage1 import Side, random_like
from translators.switch import identity_translator, translated_cache


@pytest.fixture(scope="module", params=FAMILIES)
def side(request):
    model = tiny_model(request.param)
    return Side(model, cache_layout(model))


def samples(lengths=(6, 17, 30), m=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (n,), generator=g), torch.randint(0, 97, (m,), generator=g)) for n in lengths]


def zero_map(layout):
    translator = identity_translator(layout)
    for weight in translator.maps.values():
        weight.data.zero_()
    return translator


# --- The metric -----------------------------------------------------------------------------------


def test_identity_translation_reads_the_native_attention_output_on_every_layer(side):
    for translator in (None, identity_translator(side.layout)):
        for result in measure(side, side, samples(), translator):
            assert result.cosine.shape == (side.layout.n_layers,)
            assert torch.allclose(result.cosine, torch.ones(side.layout.n_layers), atol=1e-5), result.cosine
            assert result.agreement == 1.0
    record = record_quality(side, side, samples(), None)
    assert record["floor"] == pytest.approx(1.0, abs=1e-5)  # every sample agrees fully: the floor is the lowest cosine
    assert [s["tokens"] for s in record["samples"]] == [5, 16, 29]  # cached tokens: the prefix less its last token


def test_broken_maps_read_clearly_other_attention_outputs(side):
    exact = measure(side, side, samples(), None)
    for translator in (zero_map(side.layout), random_like(identity_translator(side.layout), seed=1)):
        broken = measure(side, side, samples(), translator)
        # Per sample the weakest layer is far from native, and no layer is native on average.
        assert max(r.min_cosine for r in broken) < 0.8
        per_layer = torch.stack([r.cosine for r in broken]).mean(0)
        assert (per_layer < 0.97).all(), per_layer
        assert sum(r.agreement for r in broken) < sum(r.agreement for r in exact)


def test_cosine_falls_as_the_map_moves_away_from_the_identity():
    model = tiny_model("llama")
    side = Side(model, cache_layout(model))
    means = []
    for scale in (0.02, 0.3, 1.5):
        results = measure(side, side, samples(), noisy_identity(side.layout, scale=scale))
        means.append(sum(r.min_cosine for r in results) / len(results))
    assert 1.0 > means[0] > means[1] > means[2], means
    assert means[0] > 0.99


def _manual_attention(model, layer, hidden, keys, values, positions):
    """softmax(Q K^T / sqrt(hd)) V through o_proj, by hand: queries from `hidden` [m, d] at `positions` [m], against
    `keys`/`values` [kv_heads, T, hd] (post-RoPE) whose last m rows are the queries' own tokens (causal there)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    config = model.config
    hd = config.hidden_size // config.num_attention_heads
    m = hidden.shape[0]
    x = model.model.layers[layer].input_layernorm(hidden.view(1, m, -1))
    q = attn.q_proj(x).view(1, m, -1, hd).transpose(1, 2)  # [1, H, m, hd]
    cos, sin = model.model.rotary_emb(q, positions.view(1, -1))
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    group = config.num_attention_heads // config.num_key_value_heads
    k = keys.repeat_interleave(group, dim=0)  # [H, T, hd]
    v = values.repeat_interleave(group, dim=0)
    scores = q[0] @ k.transpose(-1, -2) / math.sqrt(hd)  # [H, m, T]
    T = k.shape[1]
    causal = torch.ones(m, T, dtype=torch.bool)
    causal[:, T - m:] = torch.tril(torch.ones(m, m, dtype=torch.bool))
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, m, hd]
    return attn.o_proj(out.transpose(0, 1).reshape(m, -1))  # [m, d]


def _manual_kv(model, layer, hidden, positions):
    """The layer's post-RoPE keys and values [kv_heads, len, hd] of hidden states [len, d] at positions [len]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    hd = model.config.hidden_size // model.config.num_attention_heads
    n = hidden.shape[0]
    x = model.model.layers[layer].input_layernorm(hidden.view(1, n, -1))
    k = attn.k_proj(x).view(1, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, -1, hd).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k, positions.view(1, -1))
    k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    return k[0], v[0]


def test_cosine_matches_a_hand_written_softmax_attention_over_the_same_queries():
    model = tiny_model("llama")
    side = Side(model, cache_layout(model))
    translator = noisy_identity(side.layout, scale=0.5, seed=3)
    prefix, continuation = samples(lengths=(21,), m=7)[0]
    n, m = prefix.numel(), continuation.numel()
    result = sample_quality(side, side, (prefix, continuation), translator)
    ids = torch.cat([prefix, continuation[:-1]])
    with torch.no_grad():
        hidden = model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states  # [L+1] of [1, n+m-1, d]
        cache = translated_cache(side, translator, capture(model, side.layout, prefix[:-1], translator.point),
                                 translator.point)
        positions = torch.arange(n + m - 1)
        queries = positions[n - 1:]
        expected = []
        for layer in range(side.layout.n_layers):
            h = hidden[layer][0]  # the layer's native input, [n+m-1, d]
            k, v = _manual_kv(model, layer, h, positions)
            native = _manual_attention(model, layer, h[n - 1:], k, v, queries)
            translated_k = torch.cat([cache.layers[layer].keys[0], k[:, n - 1:]], dim=1)  # translated prefix + own tokens
            translated_v = torch.cat([cache.layers[layer].values[0], v[:, n - 1:]], dim=1)
            read = _manual_attention(model, layer, h[n - 1:], translated_k, translated_v, queries)
            expected.append(torch.nn.functional.cosine_similarity(read, native, dim=-1).mean())
    expected = torch.stack(expected)
    assert (expected < 0.999).any()  # the check is not vacuous: the noisy map moves the outputs
    assert torch.allclose(result.cosine, expected, atol=1e-5), (result.cosine, expected)
    # The native reference holds the target's own attention outputs: the hand-written ones over its own keys.
    reference = native_reference(side, (prefix, continuation))
    with torch.no_grad():
        h = hidden[1][0]
        k, v = _manual_kv(model, 1, h, positions)
        assert torch.allclose(reference.outputs[1], _manual_attention(model, 1, h[n - 1:], k, v, queries), atol=1e-5)


def test_bad_samples_are_refused(side):
    with pytest.raises(ConfigError, match="at least two tokens"):
        sample_quality(side, side, (torch.tensor([3]), torch.tensor([4, 5])), None)
    with pytest.raises(ConfigError, match="held-out samples"):
        measure(side, side, [], None)


# --- Buckets, floor, verdict ----------------------------------------------------------------------


def test_buckets_are_powers_of_two_holding_their_upper_edge():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 1, 2, 4, 4, 8, 8, 16, 64, 128]


def fake(tokens, cosines, agreement):
    return SampleQuality(tokens=tokens, cosine=torch.tensor(cosines), agreement=agreement)


def test_record_groups_samples_by_prefix_length_with_the_weakest_layer():
    results = [fake(10, [0.99, 0.97], 1.0), fake(16, [0.95, 0.99], 0.8), fake(17, [0.90, 0.91], 0.5),
               fake(40, [0.6, 0.7], 0.0)]
    record = quality_record(results, level=0.9)
    assert record["per_layer"] == pytest.approx([(0.99 + 0.95 + 0.90 + 0.6) / 4, (0.97 + 0.99 + 0.91 + 0.7) / 4])
    assert [(b["max_tokens"], b["n"]) for b in record["buckets"]] == [(16, 2), (32, 1), (64, 1)]
    assert record["buckets"][0]["cosine"] == pytest.approx((0.97 + 0.95) / 2)  # mean of the per-sample minima
    assert record["buckets"][0]["agreement"] == pytest.approx(0.9)
    # Top samples by cosine: 0.97 (1.0), 0.95 (mean 0.9 ≥ 0.9), 0.90 (0.77 < 0.9): the floor is 0.95.
    assert record["floor"] == pytest.approx(0.95)
    assert record["n_samples"] == 4 and json.loads(json.dumps(record)) == record  # JSON-able as is


def test_floor_rule():
    assert calibrate_floor([(0.99, 1.0), (0.95, 0.9), (0.9, 0.5), (0.8, 0.0)], level=0.9) == 0.95
    # A later sample can lift the running mean back over the level: the largest qualifying set counts.
    assert calibrate_floor([(0.99, 0.8), (0.98, 1.0), (0.9, 0.95)], level=0.9) == 0.9
    # Ties on cosine enter together: (0.9, 1.0) alone would qualify, with its twin (0.9, 0.0) it does not.
    assert calibrate_floor([(0.99, 1.0), (0.9, 1.0), (0.9, 0.0)], level=0.9) == 0.99
    assert calibrate_floor([(0.99, 0.5), (0.5, 0.4)], level=0.9) == 1.0  # never reached: only exact passes
    with pytest.raises(ConfigError):
        calibrate_floor([], level=0.9)
    with pytest.raises(ConfigError):
        calibrate_floor([(0.9, 1.0)], level=0.0)


def test_verdict_at_bucket_edges():
    quality = {"metric": "attention_output_cosine", "floor": 0.95,
               "buckets": [{"max_tokens": 16, "n": 2, "cosine": 0.97}, {"max_tokens": 64, "n": 3, "cosine": 0.95},
                           {"max_tokens": 128, "n": 1, "cosine": 0.94}]}
    assert quality_verdict(quality, 0) is None and quality_verdict(quality, 16) is None
    assert quality_verdict(quality, 17) is None and quality_verdict(quality, 64) is None  # at the floor: not below
    reason = quality_verdict(quality, 65)
    assert "up to 128 tokens" in reason and "0.9400" in reason and "below the floor 0.9500" in reason
    assert quality_verdict(quality, 128) is not None
    assert "longer than every held-out prefix" in quality_verdict(quality, 129)
    # The caller's floor replaces the recorded one.
    assert quality_verdict(quality, 100, floor=0.9) is None
    assert quality_verdict(quality, 10, floor=0.98) is not None
    # No record: nothing to hold it to, unless a floor is asked for.
    assert quality_verdict(None, 10) is None
    assert "records no quality" in quality_verdict(None, 10, floor=0.9)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="n_load"):
            quality_verdict(quality, bad)


def test_verdict_on_measured_records(side):
    exact = record_quality(side, side, samples(), None)
    broken = record_quality(side, side, samples(), zero_map(side.layout))
    assert all(quality_verdict(exact, n) is None for n in (1, 5, 16, 29, 32))
    assert quality_verdict(exact, 33) is not None  # beyond what was measured
    assert broken["floor"] == 1.0  # the zero map never keeps 90% of the greedy tokens
    assert all(quality_verdict(broken, n) is not None for n in (1, 16, 32))
    # Held to the exact translator's floor, the zero map falls back too.
    assert quality_verdict(broken, 16, floor=exact["floor"]) is not None


# --- At fit time ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fit_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality-fit")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(24)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8,
                                      "n_train": 16, "n_val": 6}))
    return {"qwen": str(save_tiny_model_dir("qwen3", root / "qwen3")),
            "llama": str(save_tiny_model_dir("llama", root / "llama")), "config": str(config), "root": root}


def _fit(*args):
    from flows.cli import app

    result = CliRunner().invoke(app, ["fit", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _check_record(record, n_val, n_layers):
    assert record["metric"] == "attention_output_cosine" and record["n_samples"] == n_val
    assert len(record["per_layer"]) == n_layers and 0.0 <= record["agreement_level"] <= 1.0
    assert sum(b["n"] for b in record["buckets"]) == n_val
    bounds = [b["max_tokens"] for b in record["buckets"]]
    assert bounds == sorted(bounds) and all(bucket_of(s["tokens"]) in bounds for s in record["samples"])


def test_fit_manifests_carry_the_quality_record(fit_setup, kvlingo_home):
    out = fit_setup["root"] / "stage2"
    summary = _fit(fit_setup["qwen"], fit_setup["llama"], "--config", fit_setup["config"], "--steps", "2",
                   "--lr", "1e-3", "--output-dir", str(out))
    for stage in ("closed_form", "distilled"):
        manifest = json.loads((out / stage / "manifest.json").read_text())
        record = manifest["fit"]["quality"]
        _check_record(record, summary["n_val"], 3)
        assert summary["quality"][stage] == record
        # The gate's lookup reads the manifest's record as it is.
        longest = record["buckets"][-1]["max_tokens"]
        assert quality_verdict(record, longest + 1) is not None
    # A model fitted into itself is exact: cosine 1 and the native greedy tokens everywhere.
    self_fit = _fit(fit_setup["qwen"], fit_setup["qwen"], "--stage1-only", "--config", fit_setup["config"],
                    "--output-dir", str(fit_setup["root"] / "self"))
    record = self_fit["quality"]["closed_form"]
    assert min(s["cosine"] for s in record["samples"]) > 0.9999 and record["floor"] > 0.9999
    assert all(s["agreement"] == 1.0 for s in record["samples"])
    assert all(quality_verdict(record, s["tokens"]) is None for s in record["samples"])


def test_cross_tokenizer_fit_records_quality_through_the_mixed_cache(fit_setup, kvlingo_home):
    # The same model under a tokenizer with one added token: the alignment is 1:1, the closed form near exact.
    other = fit_setup["root"] / "other"
    tiny_model("qwen3").save_pretrained(other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    summary = _fit(fit_setup["qwen"], str(other), "--stage1-only", "--config", fit_setup["config"],
                   "--output-dir", str(fit_setup["root"] / "cross"))
    assert "alignment" in summary
    record = summary["quality"]["closed_form"]
    _check_record(record, summary["n_val"], 3)
    assert min(s["cosine"] for s in record["samples"]) > 0.999
