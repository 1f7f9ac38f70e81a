"""The run fingerprint keys run directories, stage-2 resume, sweep cells and registry tags (issue: stale results).

Regression tests for results that used to be reused under another config: a resumed stage 2 with another ridge,
head_wise, weighting, n_val or token caps trained 0 steps and relabelled the old maps.
"""

import json

import pytest
import yaml
from tiny_configs import save_tiny_model_dir, words
from typer.testing import CliRunner

from flows.cli import app
from infra.config import FitConfig
from infra.data_manifest import conversations_from_manifest, item_sha256
from infra.fingerprint import NON_RESULT_FIELDS, describe_differences, fingerprint, fingerprint_fields
from infra.rundirs import latest_fit_dir, model_slug, pair_runs_dir, run_dir
from translators.errors import ConfigError

runner = CliRunner()
SIGS = {"source": {"name": "a", "config_sha256": "1"}, "target": {"name": "b", "config_sha256": "2"}}


def fields_of(**changes):
    config = FitConfig(source="a", target="b", **changes).model_dump(mode="json")
    return fingerprint_fields(config, SIGS, "manifest-0")


@pytest.mark.parametrize("change", [
    {"ridge": 0.1}, {"head_wise": True}, {"weighting": "attention"}, {"n_val": 30}, {"max_prefix_tokens": 256},
    {"max_continuation_tokens": 32}, {"lr": 3e-3}, {"steps": 61}, {"seed": 1}, {"point": "post_norm"}, {"nu": 2},
    {"assignment": "depth"}, {"data": "embedded:500"}, {"n_train": 100}, {"batch": 4}, {"objective": "ce"},
    {"state_ridge": 0.5},
])
def test_every_result_field_changes_the_fingerprint_and_is_named(change):
    base, changed = fields_of(), fields_of(**change)
    assert fingerprint(base) != fingerprint(changed)
    assert describe_differences(base, changed).split(" ")[0] == next(iter(change))


@pytest.mark.parametrize("change", [{"workers": 2}, {"eval_every": 5}, {"checkpoint_every": 5}, {"output_dir": "/x"},
                                    {"resume": False}, {"stage1_only": True}])
def test_reporting_fields_leave_the_fingerprint_alone(change):
    assert next(iter(change)) in NON_RESULT_FIELDS
    assert fingerprint(fields_of()) == fingerprint(fields_of(**change))


def test_gpu_placement_leaves_the_fingerprint_alone():
    # FitConfig refuses gpu=True on a machine without CUDA, so the field is flipped in the dumped config.
    config = FitConfig(source="a", target="b", workers=2).model_dump(mode="json")
    assert "gpu" in NON_RESULT_FIELDS and config["gpu"] is False
    on_gpu = fingerprint_fields({**config, "gpu": True}, SIGS, "manifest-0")
    assert fingerprint(on_gpu) == fingerprint(fingerprint_fields(config, SIGS, "manifest-0"))


def test_model_build_and_data_change_the_fingerprint():
    config = FitConfig(source="a", target="b").model_dump(mode="json")
    base = fingerprint_fields(config, SIGS, "manifest-0")
    rebuilt = fingerprint_fields(config, {**SIGS, "target": {"name": "b", "config_sha256": "3"}}, "manifest-0")
    other_data = fingerprint_fields(config, SIGS, "manifest-1")
    assert len({fingerprint(base), fingerprint(rebuilt), fingerprint(other_data)}) == 3
    assert describe_differences(base, rebuilt) == "target.config_sha256"


def test_run_dirs_are_per_pair_and_fingerprint_and_safe_for_paths_and_hub_ids(kvlingo_home, tmp_path):
    local = tmp_path / "my model"
    local.mkdir()
    assert model_slug("kvlingo-tiny-s") == "kvlingo-tiny-s"
    assert model_slug("Qwen/Qwen3-0.6B") == "Qwen_Qwen3-0.6B"
    slug = model_slug(str(local))
    assert slug.startswith("my model-") and "/" not in slug and slug == model_slug(str(local) + "/")
    assert run_dir(str(local), "Qwen/Qwen3-0.6B", "ab" * 32).parent == pair_runs_dir(str(local), "Qwen/Qwen3-0.6B")
    assert str(run_dir("a", "b", "ab" * 32)).startswith(str(kvlingo_home))  # never an absolute join of a path
    with pytest.raises(ConfigError, match="run `kvlingo fit a b` first"):
        latest_fit_dir("a", "b")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp")
    qwen = save_tiny_model_dir("qwen3", root / "qwen3")
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(120, seed=i)}) for i in range(30)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 40, "max_continuation_tokens": 8,
                                      "n_train": 20, "n_val": 6, "steps": 2, "eval_every": 2, "checkpoint_every": 1}))
    return {"qwen": str(qwen), "config": str(config), "data": str(data)}


def fit(setup, *args):
    result = runner.invoke(app, ["fit", setup["qwen"], setup["qwen"], "--config", setup["config"], "--json", *args])
    return result, (json.loads(result.stdout) if result.exit_code == 0 else None)


def test_ridge_change_into_the_default_folder_retrains_and_into_one_folder_is_refused(setup, kvlingo_home, tmp_path):
    _, first = fit(setup, "--ridge", "0")
    _, second = fit(setup, "--ridge", "0.1")
    # Default folders are per fingerprint: the second run trained its own 2 steps from its own closed form.
    assert first["run_dir"] != second["run_dir"] and first["fingerprint"] != second["fingerprint"]
    assert [r["step"] for r in second["history"]] == [1, 2]
    out = tmp_path / "one"
    fit(setup, "--ridge", "0", "--output-dir", str(out))
    clash, _ = fit(setup, "--ridge", "0.1", "--output-dir", str(out))
    assert clash.exit_code == 2 and "(ridge 0.0 → 0.1)" in " ".join(clash.stderr.split())
    assert json.loads((out / "fingerprint.json").read_text())["fingerprint"] == first["fingerprint"]  # untouched
    # --no-resume replaces the old run: its maps are the ridge-0.1 run's, not relabelled old ones.
    _, replaced = fit(setup, "--ridge", "0.1", "--output-dir", str(out), "--no-resume")
    assert replaced["fingerprint"] == second["fingerprint"]
    assert replaced["val_kl"]["distilled"] == pytest.approx(second["val_kl"]["distilled"], rel=1e-9)
    manifest = json.loads((out / "distilled" / "manifest.json").read_text())
    assert manifest["fit"]["config"]["ridge"] == 0.1 and manifest["fit"]["fingerprint"] == second["fingerprint"]


def test_n_val_change_is_a_new_run_with_another_validation_set(setup, kvlingo_home):
    _, a = fit(setup, "--stage1-only")
    _, b = fit(setup, "--stage1-only", "--n-val", "8")
    assert a["fingerprint"] != b["fingerprint"]
    assert a["data_manifest"]["val_set_sha256"] != b["data_manifest"]["val_set_sha256"]


def test_data_manifest_rebuilds_the_same_conversations(setup, kvlingo_home):
    _, summary = fit(setup, "--stage1-only")
    manifest = json.loads((pair_runs_dir(setup["qwen"], setup["qwen"]) / summary["fingerprint"][:16]
                           / "data_manifest.json").read_text())
    assert len(manifest["val"]) == summary["n_val"] and len(manifest["train"]) == summary["n_train"]
    rebuilt = conversations_from_manifest(manifest)
    assert [item_sha256(d) for d in rebuilt["val"]] == manifest["val"]
    assert summary["data_manifest"]["val_set_sha256"] == manifest["val_set_sha256"]
    artifact = json.loads((pair_runs_dir(setup["qwen"], setup["qwen"]) / summary["fingerprint"][:16]
                           / "closed_form" / "manifest.json").read_text())
    assert artifact["fit"]["data_manifest"]["val"] == manifest["val"]
    other = pair_runs_dir("x", "y").parent / "other.jsonl"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text(json.dumps({"text": words(120, seed=999)}) + "\n")
    with pytest.raises(ConfigError, match=r"of the manifest are not in"):
        conversations_from_manifest(manifest, str(other))


def test_multiple_seeds_report_mean_and_seed_sd(setup, kvlingo_home):
    result, summary = fit(setup, "--seeds", "0,1", "--n-select", "0")  # each seed's last step, not a checkpoint
    assert result.exit_code == 0, result.output
    kls = [summary["by_seed"][s]["val_kl"] for s in ("0", "1")]
    assert summary["val_kl"]["distilled"] == pytest.approx(sum(kls) / 2)
    assert summary["val_kl_seed_sd"]["distilled"] == pytest.approx(abs(kls[0] - kls[1]) / 2 ** 0.5)
    assert kls[0] != kls[1]  # the seed changes the stage-2 data order
    assert "stage2_gain" not in summary and {"kl_difference", "se", "ratio"} <= set(summary["by_seed"]["1"]["stage2_gain"])
    bad, _ = fit(setup, "--seeds", "0,x")
    assert bad.exit_code == 2 and "--seeds must be comma-separated integers" in bad.stderr
