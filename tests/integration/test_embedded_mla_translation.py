"""MLA and DSA caches of the embedded family: doctor round trips of every object kind, token identity read back
from the cache, and translation into an MLA target and a DSA target's indexer (fits on the real embedded models).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.integration

FAMILY = ("kvlingo-tiny-s-mla", "kvlingo-tiny-l-mla", "kvlingo-tiny-s-dsa")


@pytest.fixture
def kvlingo_home_models(tmp_path, monkeypatch):
    """A fresh platform directory for runs and statistics; the embedded models come from the real cache."""
    from infra.settings import kvlingo_home

    models = kvlingo_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models, target_is_directory=True)
    monkeypatch.setenv("KVLINGO_HOME", str(home))
    return home


@pytest.mark.parametrize("name", FAMILY)
def test_doctor_round_trips_every_object_kind(name):
    result = CliRunner().invoke(app, ["doctor", name, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["objects"][:2] == ["latent", "rope_key"]
    assert ("indexer_keys" in report["objects"]) == name.endswith("-dsa")
    for row in report["points"].values():
        assert row["max_abs_logit_diff"] <= 1e-4 and row["grad_ok"]


@pytest.mark.parametrize("name, obj", [("kvlingo-tiny-s-mla", "latent"), ("kvlingo-tiny-s", "values")])
def test_the_codebook_reads_every_token_back_from_the_layer0_cache(name, obj):
    from infra.synthetic_chat import recall_items
    from infra.tiny_models import HELDOUT_SEED, render_chat
    from infra.zoo import load_model
    from translators.capture import capture
    from translators.token_identity import build_codebook, codebook_accuracy

    loaded = load_model(name)
    codebook = build_codebook(loaded.model, loaded.layout, "pre_norm")
    assert codebook.object == obj
    item = recall_items(1, HELDOUT_SEED)[0]
    ids = loaded.tokenizer(render_chat(item.messages, add_generation_prompt=True), return_tensors="pt").input_ids[0]
    cap = capture(loaded.model, loaded.layout, ids, "pre_norm")
    assert codebook_accuracy(codebook, cap.objects, ids) == 1.0


def fit_stage1(source: str, target: str, tmp_path, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["fit", source, target, "--stage1-only", "--output-dir",
                                      str(tmp_path / f"{source}--{target}"), *extra, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("source, target", [("kvlingo-tiny-l-mla", "kvlingo-tiny-s-mla"),
                                            ("kvlingo-tiny-l", "kvlingo-tiny-s-mla")])
def test_closed_form_into_an_mla_target_beats_both_controls(source, target, tmp_path, kvlingo_home_models):
    summary = fit_stage1(source, target, tmp_path)
    kl = summary["val_kl"]
    # Measured (n_val 24): 0.224 (MLA → MLA) and 0.359 (GQA → MLA) against controls ≥ 3.59.
    assert kl["closed_form"] < 0.8 * min(kl["empty_prefix"], kl["random_map"])
    assert set(summary["r2"]) == {"latent", "rope_key"} and min(summary["r2"].values()) > 0.8

    # Attribution re-scores the same validation conversations: its translated KL is the fit's closed form. On four
    # MLA-family fits the target's own last layer removed 49-77% of the closed form's KL (README, "Where the
    # remaining KL sits").
    result = CliRunner().invoke(app, ["attribute", str(tmp_path / f"{source}--{target}"), "--stage", "closed_form",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["translated"]["mean"] == pytest.approx(kl["closed_form"], rel=1e-5)
    last = max(row["layer"] for row in report["rows"])
    assert {row["objects"] for row in report["rows"]} == {"latent", "rope_key", "all"}
    assert len(report["rows"]) == 3 * (last + 1)
    last_all = next(r for r in report["rows"] if r["layer"] == last and r["objects"] == "all")
    assert last_all["removed"] > 2 * last_all["removed_se"] and last_all["share"] > 0.3


def test_translated_indexer_keys_select_what_the_targets_own_select(tmp_path, kvlingo_home_models):
    fit_stage1("kvlingo-tiny-l-mla", "kvlingo-tiny-s-dsa", tmp_path)
    result = CliRunner().invoke(app, ["eval", "kvlingo-tiny-l-mla", "kvlingo-tiny-s-dsa", "--benchmark", "indexer_topk",
                                      "--limit", "20", "--fit-dir", str(tmp_path / "kvlingo-tiny-l-mla--kvlingo-tiny-s-dsa"),
                                      "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["condition"]: r for r in json.loads(result.stdout)["rows"] if r["benchmark"] == "indexer_topk"}
    assert rows["closed_form"]["n"] == 20 and rows["closed_form"]["score"] >= 0.9
