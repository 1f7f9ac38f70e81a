"""MLA (latent + shared rotary key) and DSA indexer-key cache objects: layout, capture at every point against
the engine cache of a native prefill, exact RoPE un-rotation, and the capture → inject → one-step round trip."""

import pytest
import torch
from tiny_configs import MLA_FAMILIES, tiny_mla_model

from translators.capture import capture
from translators.errors import ConfigError, UnsupportedModelError
from translators.inject import decode_step, write_cache
from translators.layout import GLOBAL, AttentionKV, IndexerKeys, MLALatent, cache_layout
from translators.mla import rotate_rope_key, unrotate_rope_key
from translators.objects import DSA, INDEXER_KEYS, LATENT, MLA, ROPE_KEY, cache_objects, object_names
from translators.points import CAPTURE_POINTS
from translators.roundtrip import native_next_logits, roundtrip

N_TOKENS = 20  # longer than index_topk (6): the indexer's keys decide what attention reads


def prompt(seed=0, n=N_TOKENS):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=MLA_FAMILIES)
def mla_model(request):
    model = tiny_mla_model(request.param)
    return model, cache_layout(model)


def test_layout_reads_latent_rope_key_and_indexer(mla_model):
    model, layout = mla_model
    config = model.config
    dsa = config.model_type == "deepseek_v32"
    assert cache_objects(layout) == (DSA if dsa else MLA)
    assert object_names(layout) == (("latent", "rope_key", "indexer_keys") if dsa else ("latent", "rope_key"))
    for layer in layout.layers:
        latent = layer.object_of(MLALatent)
        assert (latent.kv_lora_rank, latent.rope_dim, latent.interleaved) == (32, 8, True)
        assert LATENT.width(layer) == 32 and ROPE_KEY.width(layer) == 8
        if dsa:
            assert layer.object_of(IndexerKeys) == IndexerKeys(head_dim=16, rope_dim=8)
            assert INDEXER_KEYS.width(layer) == 16
    assert layout.attention_types == [GLOBAL] * 3
    layer0 = layout.signature()["layers"][0]
    assert layer0["objects"][0]["kv_lora_rank"] == 32 and "n_kv_heads" not in layer0
    with pytest.raises(UnsupportedModelError, match="holds no AttentionKV"):
        layout.layers[0].object_of(AttentionKV)


def test_post_rope_capture_equals_the_engine_cache_of_a_native_prefill(mla_model):
    model, layout = mla_model
    ids = prompt()
    with torch.no_grad():
        cache = model(input_ids=ids.view(1, -1), use_cache=True).past_key_values
        cap = capture(model, layout, ids, "post_rope")
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(cap.objects["latent"][i], layer.keys[0, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(cap.objects["rope_key"][i], layer.values[0, 0], atol=1e-6, rtol=0)
        if "indexer_keys" in cap.objects:
            torch.testing.assert_close(cap.objects["indexer_keys"][i], layer.indexer_keys[0], atol=1e-6, rtol=0)


def test_rope_key_unrotation_is_exact(mla_model):
    model, layout = mla_model
    with torch.no_grad():
        post_norm = capture(model, layout, prompt(1), "post_norm")
        post_rope = capture(model, layout, prompt(1), "post_rope")
        positions = torch.arange(N_TOKENS)
        for i in range(layout.n_layers):
            back = unrotate_rope_key(model, layout, i, post_rope.objects["rope_key"][i], positions)
            torch.testing.assert_close(back, post_norm.objects["rope_key"][i], atol=1e-5, rtol=0)
            x = torch.randn(N_TOKENS, 8)
            shifted = positions + 37
            torch.testing.assert_close(
                unrotate_rope_key(model, layout, i, rotate_rope_key(model, layout, i, x, shifted), shifted), x,
                atol=1e-5, rtol=0)
        # The latent is the same at post_norm and post_rope (RoPE never touches it).
        assert all(torch.equal(a, b) for a, b in zip(post_norm.objects["latent"], post_rope.objects["latent"]))


@pytest.mark.parametrize("point", CAPTURE_POINTS)
def test_round_trip_reproduces_native_logits(mla_model, point):
    model, layout = mla_model
    result = roundtrip(model, layout, prompt(2), point)
    assert result.max_abs_logit_diff <= 1e-4
    assert result.grad_ok, result.layers_without_grad


def test_indexer_keys_decide_what_attention_reads():
    model = tiny_mla_model("deepseek_v32")
    layout = cache_layout(model)
    ids = prompt(3)
    with torch.no_grad():
        native = native_next_logits(model, ids)
        cap = capture(model, layout, ids[:-1], "pre_norm")
        shuffled = dict(cap.objects, indexer_keys=[x.flip(0) for x in cap.objects["indexer_keys"]])
        logits = decode_step(model, write_cache(model, layout, shuffled, point="pre_norm"), ids[-1:])[-1]
    assert (logits - native).abs().max() > 1e-2


def test_objects_cannot_move_back_and_write_cache_names_missing_objects(mla_model):
    model, layout = mla_model
    cap = capture(model, layout, prompt(n=4), "post_rope")
    with pytest.raises(ConfigError, match="cannot move a cache object back"):
        LATENT.advance(model, layout, 0, cap.objects["latent"][0], start="post_rope", end="pre_norm",
                       positions=torch.arange(4))
    with pytest.raises(ConfigError, match="latent"):
        write_cache(model, layout, {"keys": cap.objects["latent"], "values": cap.objects["rope_key"]},
                    point="post_rope")


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_doctor_round_trips_every_mla_object_kind(tmp_path, family):
    import json

    from tiny_configs import save_tiny_mla_model_dir, words
    from typer.testing import CliRunner

    from flows.cli import app

    directory = str(save_tiny_mla_model_dir(family, tmp_path / family))
    result = CliRunner().invoke(app, ["doctor", directory, "--prompt", words(24), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    expected = ["latent", "rope_key"] + (["indexer_keys"] if family == "deepseek_v32" else [])
    assert report["objects"] == expected and report["family"] == family
    assert all(row["max_abs_logit_diff"] <= 1e-4 and row["grad_ok"] for row in report["points"].values())
