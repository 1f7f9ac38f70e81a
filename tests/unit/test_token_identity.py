"""Token identity (hybrid paper §3.4): the codebook decodes ids from the source's own layer-0 cache, the
maps append the target's embedding of each id, and the variant travels with the artifact."""

import json

import pytest
import torch
from tiny_configs import save_tiny_mla_model_dir, tiny_mla_model, tiny_model, words
from typer.testing import CliRunner

from translators.artifact import load_translator, save_translator
from translators.capture import capture
from translators.errors import ConfigError
from translators.layout import cache_layout
from translators.points import CAPTURE_POINTS
from translators.stage1 import Side, accumulate_pair, candidate_layers, empty_stats, solve_translator
from translators.switch import check_translator_fits, translated_cache
from translators.token_identity import (
    attach_token_identity,
    build_codebook,
    check_variant,
    codebook_accuracy,
    make_token_identity,
    target_embedding,
)
from translators.translator import TOKEN_EMBEDDING


def prompts(k, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g) for _ in range(k)]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
@pytest.mark.parametrize("point", CAPTURE_POINTS)
def test_codebook_recovers_every_token_from_the_layer0_cache(family, point):
    model = tiny_mla_model(family) if family.startswith("deepseek") else tiny_model(family)
    layout = cache_layout(model)
    codebook = build_codebook(model, layout, point)
    assert codebook.object == ("latent" if family == "deepseek_v3" else "values")
    assert codebook.rows.shape[0] == 97
    ids = prompts(1, n=60)[0]
    assert codebook_accuracy(codebook, capture(model, layout, ids, point).objects, ids) == 1.0


def fit_with_tokens(variant, point="pre_norm"):
    source = Side(tiny_mla_model("deepseek_v3", 1), None)
    target = Side(tiny_mla_model("deepseek_v3", 2, kv_lora_rank=24), None)
    source, target = Side(source.model, cache_layout(source.model)), Side(target.model, cache_layout(target.model))
    tokens = make_token_identity(variant, source.model, source.layout, target.model, point)
    cands = candidate_layers(source.layout, target.layout, "depth", 1)
    stats = empty_stats(source.layout, target.layout, cands, token_width=tokens.width)
    samples = [(p, p[-4:]) for p in prompts(8)]
    accumulate_pair(stats, source, target, samples, point, token_identity=tokens)
    translator = solve_translator(stats, {n: cands for n in stats}, source.layout, target.layout, point,
                                  token_identity=variant)
    translator.token_module = tokens
    return source, target, translator, cands


def test_maps_append_the_target_embedding_and_equal_least_squares():
    source, target, translator, cands = fit_with_tokens("codebook")
    assert translator.inputs == {"latent": ("latent", TOKEN_EMBEDDING), "rope_key": ("rope_key", TOKEN_EMBEDDING)}
    assert translator.widths("latent") == (32 + 64, 24)
    embedding = target_embedding(target.model)  # [97, 64]
    with torch.no_grad():
        caps = [(capture(source.model, source.layout, p, "pre_norm"), capture(target.model, target.layout, p, "pre_norm"))
                for p in prompts(8)]
    for t, (s,) in cands.items():
        for name in translator.objects:
            x = torch.cat([torch.cat([cs.objects[name][s], embedding[cs.token_ids]], -1) for cs, _ in caps])
            y = torch.cat([ct.objects[name][t] for _, ct in caps])
            reference = torch.linalg.lstsq(x.double(), y.double()).solution.T
            torch.testing.assert_close(translator.weight(name, t).double(), reference, atol=2e-3, rtol=2e-3)


def test_variants_agree_where_the_codebook_is_exact_and_ids_must_be_given():
    source, target, by_codebook, _ = fit_with_tokens("codebook")
    _, _, by_ids, _ = fit_with_tokens("ids")
    ids = prompts(1, seed=7)[0]
    cap = capture(source.model, source.layout, ids, "pre_norm")
    a = by_codebook.translate_objects(cap.objects)
    b = by_ids.translate_objects(cap.objects, cap.token_ids)
    for name in a:
        for x, y in zip(a[name], b[name]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="pass the prompt's ids"):
        by_ids.translate_objects(cap.objects)
    # The switch passes the capture's ids along.
    translated_cache(target, by_ids, cap, "pre_norm")


def test_artifact_records_the_variant_and_loading_needs_the_pair(tmp_path):
    source, target, translator, _ = fit_with_tokens("codebook")
    save_translator(translator, tmp_path, source={"name": "s"}, target={"name": "t"}, fit={})
    loaded, manifest = load_translator(tmp_path)
    assert manifest["token_identity"] == "codebook" and loaded.token_identity == "codebook"
    check_translator_fits(loaded, source.layout, target.layout)
    cap = capture(source.model, source.layout, prompts(1, seed=3)[0], "pre_norm")
    with pytest.raises(ConfigError, match="attach it for the loaded pair"):
        loaded.translate_objects(cap.objects)
    attach_token_identity(loaded, source.model, source.layout, target.model)
    expected = translator.translate_objects(cap.objects)
    for name, xs in loaded.translate_objects(cap.objects).items():
        assert all(torch.equal(x, y) for x, y in zip(xs, expected[name]))
    # A target with another embedding width does not fit the maps.
    from translators.errors import PairMismatchError

    other = tiny_mla_model("deepseek_v3", 2, kv_lora_rank=24, hidden_size=32)
    with pytest.raises(PairMismatchError, match="token embedding of width"):
        attach_token_identity(loaded, source.model, source.layout, other)


def test_variant_names_are_checked():
    assert check_variant(None) is None and check_variant("ids") == "ids"
    with pytest.raises(ConfigError, match="codebook, ids"):
        check_variant("embedding")


def test_fit_cli_with_token_identity(tmp_path, kvlingo_home):
    from flows.cli import app

    src = save_tiny_mla_model_dir("deepseek_v3", tmp_path / "src", seed=1)
    tgt = save_tiny_mla_model_dir("deepseek_v32", tmp_path / "tgt", seed=2)
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(16)))
    config = tmp_path / "fit.yaml"
    config.write_text(f"data: {data}\nmax_prefix_tokens: 40\nmax_continuation_tokens: 8\nn_train: 12\nn_val: 4\n")
    common = ["fit", str(src), str(tgt), "--stage1-only", "--config", str(config), "--assignment", "depth", "--json"]
    result = CliRunner().invoke(app, [*common, "--token-identity", "codebook", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert set(summary["r2"]) == {"latent", "rope_key", "indexer_keys"}
    assert summary["codebook_accuracy"] == 1.0  # every held-out token read back from the source's cache
    manifest = json.loads((tmp_path / "out" / "closed_form" / "manifest.json").read_text())
    assert manifest["token_identity"] == "codebook"
    assert manifest["inputs"]["indexer_keys"] == ["latent", "rope_key", TOKEN_EMBEDDING]
    bad = CliRunner().invoke(app, [*common, "--token-identity", "embedding"])
    assert bad.exit_code == 2 and "token_identity" in bad.output
