"""`kvlingo fit --stage1-only` on tiny local models: the JSON contract, the YAML config path, clear errors."""

import json
from pathlib import Path

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, tiny_model, words, write_small_fit
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    qwen = save_tiny_model_dir("qwen3", root / "qwen3")
    llama = save_tiny_model_dir("llama", root / "llama")
    data, config = write_small_fit(root)
    return {"qwen": str(qwen), "llama": str(llama), "data": str(data), "config": str(config), "root": root}


def fit(setup, *args):
    return runner.invoke(app, ["fit", *args, "--stage1-only", "--config", setup["config"], "--json"])


def test_self_fit_json_contract_and_artifact(setup, kvlingo_home):
    out = setup["root"] / "self"
    result = fit(setup, setup["qwen"], setup["qwen"], "--assignment", "greedy", "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["source"] == setup["qwen"] and summary["target"] == setup["qwen"]
    kl = summary["val_kl"]
    assert set(kl) >= {"closed_form", "empty_prefix", "random_map"}
    # Translating a model into itself is exact: the closed form must reach the native prefill.
    assert kl["closed_form"] < 1e-5 < kl["empty_prefix"] and kl["closed_form"] < kl["random_map"]
    assert summary["r2"]["keys"] > 0.999 and summary["r2"]["values"] > 0.999
    assert (out / "closed_form" / "manifest.json").is_file()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["assignment"] == "greedy" and saved["max_prefix_tokens"] == 40  # YAML + CLI override resolved
    # Token identity's default, auto, chose the codebook for this one-tokenizer attention pair: the saved config,
    # the manifest and the translator's map widths (the target's embedding, 64 wide, appended) all record it.
    manifest = json.loads((out / "closed_form" / "manifest.json").read_text())
    assert saved["token_identity"] == "codebook" == manifest["token_identity"] == manifest["fit"]["config"]["token_identity"]
    assert summary["codebook_accuracy"] == 1.0


@pytest.mark.parametrize("target, args, chosen", [("llama", ["--token-identity", "none"], None),
                                                  ("llama", ["--head-wise"], None),
                                                  ("llama", ["--token-identity", "ids"], "ids"),
                                                  ("mla", [], None)])
def test_token_identity_auto_is_off_where_asked_or_where_it_was_not_measured_to_help(setup, kvlingo_home, tmp_path,
                                                                                    target, args, chosen):
    """auto turns the codebook on for one-tokenizer GQA pairs only: not across head-wise maps, nor into MLA."""
    from tiny_configs import save_tiny_mla_model_dir

    target_dir = setup["llama"] if target == "llama" else str(save_tiny_mla_model_dir("deepseek_v3", tmp_path / "mla"))
    result = fit(setup, setup["qwen"], target_dir, *args, "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["token_identity"] == chosen
    manifest = json.loads((tmp_path / "out" / "closed_form" / "manifest.json").read_text())
    assert manifest.get("token_identity") == chosen


def test_cross_family_pair_fits(setup, kvlingo_home):
    result = fit(setup, setup["qwen"], setup["llama"], "--nu", "2", "--assignment", "r2")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert all(len(v) == 2 for v in summary["assignment"]["keys"].values())
    assert summary["val_kl"]["closed_form"] < summary["val_kl"]["random_map"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["{qwen}", "{qwen}", "--assignment", "gredy"], "did you mean 'greedy'"),
        (["{qwen}", "nosuchmodel"], "target: unknown model 'nosuchmodel'"),
        (["{qwen}", "{qwen}", "--nu", "7"], "ν = 7 is larger than the source depth (3 layers)"),
        (["{qwen}", "{qwen}", "--data", "/nonexistent/file.jsonl"], "looked for"),
        (["{qwen}", "{qwen}", "--point", "pre"], "point"),
        (["{qwen}", "{qwen}", "--nu", "0"], "nu: Input should be greater than or equal to 1"),
        (["{qwen}", "{qwen}", "--token-identity", "codebok"], "token_identity: Input should be 'auto', 'codebook' or 'ids'"),
    ],
)
def test_bad_input_exits_2(setup, kvlingo_home, args, message):
    args = [a.format(**setup) for a in args]
    result = fit(setup, *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())


def test_several_problems_reported_at_once(setup, kvlingo_home):
    result = fit(setup, "nosuchsource", "nosuchtarget", "--assignment", "best")
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "source: unknown model" in err and "target: unknown model" in err and "assignment:" in err


def test_different_tokenizers_are_fitted_through_the_alignment(setup, kvlingo_home, tmp_path):
    # Tokenizers that differ (here by one added token) are no longer refused: the fit aligns the two tokenizations
    # of each text window by character offsets (App. K). Identical segmentations give one 1:1 group per token.
    other = tmp_path / "other"
    tiny_model("qwen3").save_pretrained(other)
    from tiny_configs import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    result = fit(setup, setup["qwen"], str(other), "--stage1-only", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    alignment = summary["alignment"]
    assert alignment["samples"] == summary["n_train"] and alignment["translated_source_tokens"] > 0
    # Text windows: everything but the last group is translated, the target prefills only that last token.
    assert 0 < alignment["target_prefilled_share"] < 0.1
    assert summary["val_kl"]["closed_form"] < summary["val_kl"]["random_map"]
    # auto leaves token identity off across tokenizers (on SmolLM2 -> Gemma-3 stage 2 made the ids variant worse).
    assert yaml.safe_load((Path(summary["run_dir"]) / "config.yaml").read_text())["token_identity"] is None
    # ids: the target's embedding of each aligned target token; the codebook (source ids) is refused, naming ids.
    with_ids = fit(setup, setup["qwen"], str(other), "--stage1-only", "--token-identity", "ids", "--json")
    assert with_ids.exit_code == 0, with_ids.stderr
    ids_summary = json.loads(with_ids.stdout)
    manifest = json.loads((Path(ids_summary["artifact"]) / "manifest.json").read_text())
    assert manifest["token_identity"] == "ids" and manifest["fit"]["config"]["token_identity"] == "ids"
    assert ids_summary["val_kl"]["closed_form"] < ids_summary["val_kl"]["random_map"]
    codebook = fit(setup, setup["qwen"], str(other), "--stage1-only", "--token-identity", "codebook")
    assert codebook.exit_code == 2 and "use --token-identity ids" in " ".join(codebook.stderr.split())


def test_empty_dataset_and_too_long_prefix(setup, kvlingo_home, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = fit(setup, setup["qwen"], setup["qwen"], "--data", str(empty))
    assert result.exit_code == 2 and "empty dataset" in result.stderr
    long_cfg = tmp_path / "long.yaml"
    long_docs = tmp_path / "long.jsonl"
    long_docs.write_text("\n".join(json.dumps({"text": words(300, seed=i)}) for i in range(8)))
    long_cfg.write_text(yaml.safe_dump({"data": str(long_docs), "max_prefix_tokens": 120, "max_continuation_tokens": 30}))
    result = runner.invoke(app, ["fit", setup["qwen"], setup["qwen"], "--stage1-only", "--config", str(long_cfg)])
    assert result.exit_code == 2 and "more than the 128 positions" in " ".join(result.stderr.split())


def test_fit_with_stage2_adds_distilled_kl_and_steps(setup, kvlingo_home):
    out = setup["root"] / "stage2"
    result = runner.invoke(app, ["fit", setup["qwen"], setup["llama"], "--config", setup["config"], "--steps", "4",
                                 "--lr", "1e-3", "--output-dir", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 4 and isinstance(summary["val_kl"]["distilled"], float)
    assert {"closed_form", "empty_prefix", "random_map"} <= set(summary["val_kl"])  # stage-1 keys kept
    # The paired gain: a mean of differences is the difference of the means (so the closed form rescored for the
    # pairing equals its stage-1 score), and a paired SE is at most the two SEs added.
    kl, se, gain = summary["val_kl"], summary["val_kl_se"], summary["stage2_gain"]
    assert gain["kl_difference"] == pytest.approx(kl["distilled"] - kl["closed_form"], abs=1e-9)
    assert gain["ratio"] == pytest.approx(kl["distilled"] / kl["closed_form"], rel=1e-9)
    assert 0 <= gain["se"] <= se["distilled"] + se["closed_form"] + 1e-12
    assert (out / "distilled" / "manifest.json").is_file() and (out / "checkpoints" / "step_000004").is_dir()
    # Re-running the same fit resumes from the final checkpoint instead of training again.
    again = runner.invoke(app, ["fit", setup["qwen"], setup["llama"], "--config", setup["config"], "--steps", "4",
                                "--lr", "1e-3", "--output-dir", str(out), "--json"])
    assert json.loads(again.stdout)["val_kl"]["distilled"] == pytest.approx(summary["val_kl"]["distilled"], abs=1e-9)
    table = runner.invoke(app, ["fit", setup["qwen"], setup["llama"], "--config", setup["config"], "--steps", "4",
                                "--lr", "1e-3", "--output-dir", str(out)])
    assert table.exit_code == 0, table.output
    assert f"distilled − closed form {gain['kl_difference']:+.4f} ± {gain['se']:.4f}" in " ".join(table.stdout.split())
    # A different learning rate into the same directory would mix two runs: refused, naming the field.
    clash = runner.invoke(app, ["fit", setup["qwen"], setup["llama"], "--config", setup["config"], "--steps", "4",
                                "--lr", "2e-3", "--output-dir", str(out), "--json"])
    assert clash.exit_code == 2 and "holds another run (lr 0.001 → 0.002)" in " ".join(clash.stderr.split())


def test_non_positive_learning_rate_is_refused_before_loading(setup, kvlingo_home):
    result = runner.invoke(app, ["fit", setup["qwen"], setup["qwen"], "--lr", "0", "--config", setup["config"]])
    assert result.exit_code == 2 and "lr: Input should be greater than 0" in result.stderr


def test_stats_samples_limits_stage_one_to_the_first_training_samples(setup, kvlingo_home):
    every = json.loads(fit(setup, setup["qwen"], setup["llama"], "--output-dir", str(setup["root"] / "all")).stdout)
    first = json.loads(fit(setup, setup["qwen"], setup["llama"], "--stats-samples", "8",
                           "--output-dir", str(setup["root"] / "first8")).stdout)
    assert every["n_stats"] == every["n_train"] > 8 and first["n_stats"] == 8 and first["n_train"] == every["n_train"]
    assert 0 < first["train_tokens"] < every["train_tokens"]
    assert first["val_kl"]["closed_form"] != every["val_kl"]["closed_form"]  # fitted on other statistics
    # As many as the training set holds is the same fit as the default (all of them).
    same = json.loads(fit(setup, setup["qwen"], setup["llama"], "--stats-samples", str(every["n_train"]),
                          "--output-dir", str(setup["root"] / "firstall")).stdout)
    assert same["val_kl"]["closed_form"] == every["val_kl"]["closed_form"]
    assert same["train_tokens"] == every["train_tokens"]


def test_repeated_data_is_a_mixture_recorded_in_config_and_manifest(setup, kvlingo_home, tmp_path):
    import json as _json

    from tiny_configs import words

    other = tmp_path / "more.jsonl"
    other.write_text("\n".join(_json.dumps({"text": words(120, seed=100 + i)}) for i in range(30)))
    out = tmp_path / "mix"
    result = fit(setup, setup["qwen"], setup["qwen"], "--data", setup["data"], "--data", str(other),
                 "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["data"] == [setup["data"], str(other)]
    manifest = json.loads((out / "data_manifest.json").read_text())
    assert manifest["source"] == [setup["data"], str(other)]
    # 26 documents, alternately from each file: 13 of each, split between training and validation.
    assert len(manifest["train"]) + len(manifest["val"]) == 26


def test_a_bad_mixture_is_refused_before_any_model_loads(setup):
    result = fit(setup, "no-such-model", "no-such-model", "--data", setup["data"], "--data", setup["data"])
    assert result.exit_code == 2
    assert "a mixture names" in result.output and "more than once" in result.output
