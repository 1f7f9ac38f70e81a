"""Layer attribution: a model translated into itself by identity maps with one map broken. Substituting the broken
object natively must restore the native prefill (KL 0, an independent reference), every other substitution must
leave the translated KL as it is; `kvlingo attribute` reproduces the fit's own validation KL and refuses bad fit
directories by name."""

import json

import pytest
import torch
from tiny_configs import save_tiny_model_dir, tiny_mla_model, tiny_model, write_small_fit
from typer.testing import CliRunner

from flows.cli import app
from translators.attribution import ALL_OBJECTS, layer_attribution
from translators.errors import ConfigError
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.switch import identity_translator

runner = CliRunner()


def samples(k, n=20, m=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (n,), generator=g), torch.randint(0, 97, (m,), generator=g)) for _ in range(k)]


@pytest.mark.parametrize("model, broken", [(tiny_model("qwen3"), ("values", 1)),
                                           (tiny_mla_model("deepseek_v3", seed=1), ("rope_key", 1))])
def test_the_broken_map_is_found_and_substituting_it_restores_the_native_prefill(model, broken):
    side = Side(model, cache_layout(model))
    translator = identity_translator(side.layout)
    name, layer = broken
    width = translator.maps[f"{name}_{layer}"].shape[0]
    translator.set_weight(name, layer, 0.2 * torch.eye(width))  # shrunk: the layer's attention reads wrong objects
    translated, rows = layer_attribution(side, side, samples(4), translator)
    assert translated.mean > 1e-3 and translated.n == 4
    groups = len(translator.objects) + 1
    assert len(rows) == side.layout.n_layers * groups
    assert {r.objects for r in rows} == {*translator.objects, ALL_OBJECTS}
    for row in rows:
        if row.layer == layer and row.objects in (name, ALL_OBJECTS):
            # The rest is exact, so the target's own object gives the native prefill back.
            assert row.kl.mean < 1e-6
            assert row.removed == pytest.approx(translated.mean, abs=1e-6)
            assert row.row(translated.mean)["share"] == pytest.approx(1.0, abs=1e-4)
        else:
            assert row.kl.mean == pytest.approx(translated.mean, rel=1e-5, abs=1e-7)
            assert abs(row.removed) < 1e-6


def test_fewer_than_two_samples_is_refused():
    side = Side(tiny_model("llama"), cache_layout(tiny_model("llama")))
    with pytest.raises(ConfigError, match="at least 2 samples, got 1"):
        layer_attribution(side, side, samples(1), identity_translator(side.layout))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("attribute")
    qwen = save_tiny_model_dir("qwen3", root / "qwen3")
    llama = save_tiny_model_dir("llama", root / "llama")
    _, config = write_small_fit(root, token_identity="none")
    return {"qwen": str(qwen), "llama": str(llama), "config": str(config), "root": root}


def test_attribute_reproduces_the_fits_validation_kl_and_refuses_bad_input(fitted, kvlingo_home):
    out = fitted["root"] / "run"
    fit = runner.invoke(app, ["fit", fitted["qwen"], fitted["llama"], "--stage1-only", "--config", fitted["config"],
                              "--output-dir", str(out), "--json"])
    assert fit.exit_code == 0, fit.output
    summary = json.loads(fit.stdout)
    result = runner.invoke(app, ["attribute", str(out), "--stage", "closed_form", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # The same validation conversations through another code path: the fit's own closed-form KL.
    assert report["translated"]["mean"] == pytest.approx(summary["val_kl"]["closed_form"], rel=1e-5)
    assert report["n_val"] == summary["n_val"] and report["translated"]["n"] == summary["n_val"]
    n_layers = 1 + max(row["layer"] for row in report["rows"])
    assert len(report["rows"]) == 3 * n_layers  # keys, values, both
    for row in report["rows"]:
        assert row["removed"] == pytest.approx(report["translated"]["mean"] - row["kl"], abs=1e-9)
    table = runner.invoke(app, ["attribute", str(out), "--stage", "closed_form"])
    assert table.exit_code == 0 and "removed ± paired se" in table.stdout

    # A stage-1-only fit has no distilled translator; a directory that is no fit; an unknown stage.
    missing = runner.invoke(app, ["attribute", str(out)])
    assert missing.exit_code == 2 and "distilled/manifest.json" in missing.output and "--stage1-only" in missing.output
    empty = runner.invoke(app, ["attribute", str(fitted["root"])])
    assert empty.exit_code == 2
    assert all(name in empty.output for name in ("config.yaml", "data_manifest.json", "distilled/manifest.json"))
    stage = runner.invoke(app, ["attribute", str(out), "--stage", "best"])
    assert stage.exit_code == 2 and "closed_form, distilled" in stage.output

    # Data that changed since the fit no longer gives its split: refused before any translator is scored.
    write_small_fit(fitted["root"], seed_offset=100, token_identity="none")
    stale = runner.invoke(app, ["attribute", str(out), "--stage", "closed_form"])
    assert stale.exit_code == 2 and "data manifest differs" in stale.output
