"""`kvlingo fit` with a hybrid side (tasks.hybrid_fit) on tiny local models: the JSON contract, the exact
self-pair, both artifacts and their integrity checks, and the settings it refuses."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from tiny_configs import save_tiny_model_dir, tiny_gdn_model, tiny_tokenizer, words
from typer.testing import CliRunner

from flows.cli import app
from translators.artifact import ArtifactError
from translators.errors import ConfigError, PairMismatchError
from translators.hybrid_artifact import load_hybrid_translator

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_fit")
    gdn, other = root / "gdn", root / "gdn_other"
    for path, seed in ((gdn, 0), (other, 1)):
        tiny_gdn_model(seed=seed).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    qwen = save_tiny_model_dir("qwen3", root / "qwen3", seed=1)
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(100)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8,
                                      "n_train": 80, "n_val": 8, "stats_samples": 32, "n_select": 8, "steps": 6,
                                      "batch": 2, "eval_every": 3, "lr": 1e-3}))
    return {"gdn": str(gdn), "other": str(other), "qwen": str(qwen), "config": str(config), "root": root}


def fit(setup, *args):
    return runner.invoke(app, ["fit", *args, "--config", setup["config"], "--json"])


def test_a_hybrid_self_pair_fits_exactly_and_saves_both_artifacts(setup, kvlingo_home):
    out = setup["root"] / "self"
    result = fit(setup, setup["gdn"], setup["gdn"], "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["hybrid"] is True
    assert summary["strategies"] == ["zero", "copy", "copy_corrected", "replay", "selected"]
    kl = summary["val_kl"]
    assert kl["copy"] < 1e-5 < kl["zero"]  # copied states and least-squares identity K/V maps: the native cache
    assert kl["closed_form"] == min(kl[s] for s in summary["strategies"]) or kl["closed_form"] < 1e-5
    assert kl["distilled"] <= kl["closed_form"] + 1e-6 < kl["empty_prefix"]  # step 0 is a checkpoint candidate
    assert kl["random_map"] > 10 * kl["closed_form"]
    assert summary["stage2"]["selection_kl"].keys() == {"0", "3", "6"}
    assert (out / "summary.json").is_file() and json.loads((out / "summary.json").read_text())["hybrid"] is True
    for stage in ("closed_form", "distilled"):
        assert (out / stage / "weights.safetensors").is_file()


def test_gqa_into_a_hybrid_replays_and_its_artifact_round_trips(setup, kvlingo_home):
    from infra.zoo import load_model, model_signature
    from translators.hybrid import hybrid_validation_kl

    out = setup["root"] / "gqa"
    result = fit(setup, setup["qwen"], setup["gdn"], "--output-dir", str(out), "--stage1-only")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["strategies"] == ["zero", "replay"] and "distilled" not in summary["val_kl"]
    source, target = load_model(setup["qwen"]), load_model(setup["gdn"])
    translator, manifest = load_hybrid_translator(out / "closed_form", source.layout, target.layout, target.model,
                                                  source=model_signature(source), target=model_signature(target))
    assert manifest["strategies"] == {"0": summary["closed_form_strategy"], "1": summary["closed_form_strategy"]}
    samples = [(torch.randint(3, 97, (20,)), torch.randint(3, 97, (4,))) for _ in range(2)]
    kl = hybrid_validation_kl(source.model, source.layout, target.model, target.layout, samples, translator)
    assert kl.mean < 50  # a working translator (the loaded maps are used; exact values depend on the fit)
    other = load_model(setup["other"])
    with pytest.raises(PairMismatchError, match="fitted for another target model"):
        load_hybrid_translator(out / "closed_form", source.layout, other.layout, other.model,
                               target=model_signature(other))
    weights = out / "closed_form" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ArtifactError, match="was modified or corrupted"):
        load_hybrid_translator(out / "closed_form", source.layout, target.layout, target.model)


def test_gqa_only_settings_are_refused_together(setup, kvlingo_home):
    result = fit(setup, setup["qwen"], setup["gdn"], "--nu", "2", "--head-wise", "--stage1-only")
    assert result.exit_code == 2, result.output
    assert "hybrid caches are fitted by their own closed forms" in result.output
    assert "nu=2" in result.output and "head_wise=True" in result.output


def test_state_ridge_is_refused_for_a_pair_without_states(setup, kvlingo_home):
    result = fit(setup, setup["qwen"], setup["qwen"], "--state-ridge", "0.5", "--stage1-only")
    assert result.exit_code == 2, result.output
    assert "state_ridge=0.5" in result.output and "cache no recurrent states" in result.output


def test_bench_multiturn_hands_off_between_hybrids_from_their_fits(setup, kvlingo_home):
    """A hybrid self-pair's closed form is exact, so every hand-off mode answers as re-prefill does; segment
    translates each span once, naive again."""
    long = setup["root"] / "gdn_long"  # hand-off conversations run past the tiny default of 128 positions
    tiny_gdn_model(seed=0, max_position_embeddings=1024).save_pretrained(long)
    tiny_tokenizer().save_pretrained(long)
    long = str(long)
    out = setup["root"] / "turns"
    assert fit(setup, long, long, "--output-dir", str(out), "--stage1-only").exit_code == 0
    result = runner.invoke(app, ["bench", "multiturn", long, long, "--fit-dir-ab", str(out),
                                 "--fit-dir-ba", str(out), "--stage", "closed_form", "--conversations", "2",
                                 "--turns", "4", "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.stdout)["modes"]
    assert modes["segment"]["per_turn"] == modes["reprefill"]["per_turn"] == modes["naive"]["per_turn"]
    assert modes["segment"]["max_times_a_span_was_translated"] == 1
    assert modes["naive"]["max_times_a_span_was_translated"] == 3
    result = runner.invoke(app, ["bench", "multiturn", long, long, "--translator-ab", "identity",
                                 "--fit-dir-ba", str(out), "--stage", "closed_form", "--json"])
    assert result.exit_code == 2 and "hybrid translators are read from an artifact directory" in result.output


def test_kvlingo_eval_scores_a_hybrid_fit_like_the_native_prefill(setup, kvlingo_home):
    """A hybrid self-pair's closed form is exact: on every metric `kvlingo eval` scores it as the target's own
    prefill; an identity reference is refused for a hybrid pair."""
    out = setup["root"] / "eval"
    assert fit(setup, setup["gdn"], setup["gdn"], "--output-dir", str(out), "--stage1-only").exit_code == 0
    result = runner.invoke(app, ["eval", setup["gdn"], setup["gdn"], "--fit-dir", str(out), "--limit", "3",
                                 "--benchmark", "corpus_kl", "--benchmark", "recall", "--benchmark", "ruler_noise",
                                 "--ruler-lengths", "24,40", "--benchmark", "switch_quality", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["errors"] == [] and "closed_form" in report["conditions"]
    rows = {(r["benchmark"], r["condition"]): r for r in report["rows"]}
    benchmarks = {b for b, _ in rows}
    assert benchmarks == {"corpus_kl", "recall", "ruler_noise_24", "ruler_noise_40", "switch_quality"}
    for bench in benchmarks:
        native, translated = rows[(bench, "target_native")], rows[(bench, "closed_form")]
        assert translated["n"] == native["n"] > 0
        assert translated["score"] == pytest.approx(native["score"], abs=1e-4), bench
    assert rows[("corpus_kl", "closed_form")]["score"] <= 1e-4 < rows[("corpus_kl", "empty_prefix")]["score"]
    assert rows[("switch_quality", "closed_form")]["score"] == 1.0
    result = runner.invoke(app, ["eval", setup["gdn"], setup["gdn"], "--translator", "identity",
                                 "--fit-dir", str(out), "--benchmark", "recall", "--json"])
    assert result.exit_code == 2 and "hybrid translators are read from an artifact directory" in result.output


def test_mla_into_a_kda_hybrid_with_token_identity_round_trips_through_its_artifact(setup, kvlingo_home):
    """MLA → Kimi-Linear: latent maps for the NoPE MLA layer, replay for the KDA layers, the source's codebook
    appending the target's embedding of every token; the loaded artifact (module re-attached) scores the same."""
    from tiny_configs import save_tiny_mla_model_dir, tiny_kda_model

    from infra.zoo import load_model, model_signature
    from translators.hybrid import attach_token_identity, hybrid_validation_kl

    mla = save_tiny_mla_model_dir("deepseek_v3", setup["root"] / "mla", seed=1)
    kda = setup["root"] / "kda"
    tiny_kda_model(seed=0).save_pretrained(kda)
    tiny_tokenizer().save_pretrained(kda)
    out = setup["root"] / "mla_kda"
    result = fit(setup, str(mla), str(kda), "--output-dir", str(out), "--stage1-only", "--token-identity", "codebook")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["strategies"] == ["zero", "replay"]
    source, target = load_model(str(mla)), load_model(str(kda))
    translator, manifest = load_hybrid_translator(out / "closed_form", source.layout, target.layout, target.model)
    assert manifest["token_identity"] == "codebook" and translator.kv["latent_2"].shape == (32, 32 + 64)
    attach_token_identity(translator, source.model, source.layout, target.model)
    samples = [(torch.randint(3, 97, (20,)), torch.randint(3, 97, (4,))) for _ in range(2)]
    reloaded = hybrid_validation_kl(source.model, source.layout, target.model, target.layout, samples, translator)
    empty = hybrid_validation_kl(source.model, source.layout, target.model, target.layout, samples, None,
                                 condition="empty_prefix")
    assert reloaded.mean < empty.mean, (reloaded, empty)
    translator.token_module = None
    with pytest.raises(ConfigError, match="attach it for the loaded pair"):
        hybrid_validation_kl(source.model, source.layout, target.model, target.layout, samples, translator)
