"""Switch timing for hybrid caches (evals.hybrid_speed, `kvlingo bench speed` with a hybrid side) on tiny local
models: the stage breakdown adds up, an exact route picks re-prefill's token, the CLI's JSON per route, errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_configs import exact_hybrid_copy, save_tiny_model_dir, tiny_gdn_model, tiny_tokenizer
from typer.testing import CliRunner

from evals.hybrid_speed import measure_hybrid_speed
from flows.cli import app
from translators.errors import ConfigError
from translators.hybrid import make_translator, strategies_for
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.states import ZERO

runner = CliRunner()


def test_stages_add_up_and_an_exact_route_picks_the_re_prefill_token():
    model = tiny_gdn_model(seed=0)
    layout = cache_layout(model)
    side = Side(model, layout)
    routes = {"copy": exact_hybrid_copy(layout), "zero": make_translator(layout, layout, model, strategies_for(layout, ZERO))}
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0))
    rows = measure_hybrid_speed(side, side, routes, prompt, repeats=2)
    assert [r.route for r in rows] == ["copy", "zero"] and {r.n for r in rows} == {40}
    for r in rows:
        stages = r.maps_s + r.states_s + r.inject_s + r.first_step_s
        assert 0 < r.switch_s and r.switch_s == pytest.approx(stages, rel=1e-9)  # two repeats: medians are means
        assert r.ratio == pytest.approx(r.prefill_s / r.switch_s)
    assert rows[0].first_token_match is True  # identity maps and copied states are the native cache
    with pytest.raises(ConfigError, match="need n ≥ 2, repeats ≥ 1 and a translator"):
        measure_hybrid_speed(side, side, {}, prompt)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_bench")
    gdn = root / "gdn"
    tiny_gdn_model(seed=0).save_pretrained(gdn)
    tiny_tokenizer().save_pretrained(gdn)
    return {"gdn": str(gdn), "qwen": str(save_tiny_model_dir("qwen3", root / "qwen3", seed=1))}


def _bench(*args):
    return runner.invoke(app, ["bench", "speed", *args])


def test_bench_speed_reports_every_route_into_a_hybrid(dirs, kvlingo_home):
    result = _bench(dirs["qwen"], dirs["gdn"], "--lengths", "24,48", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["hybrid"] is True and report["routes"] == ["replay", "zero"]
    assert [(r["n"], r["route"]) for r in report["rows"]] == [(24, "replay"), (24, "zero"), (48, "replay"), (48, "zero")]
    for row in report["rows"]:
        assert row["switch_s"] > 0 and row["prefill_s"] > 0 and row["states_s"] >= 0
    replay = [r for r in report["rows"] if r["route"] == "replay"]
    zero = [r for r in report["rows"] if r["route"] == "zero"]
    assert all(r["states_s"] > z["states_s"] for r, z in zip(replay, zero))  # replay runs the mixers, zero does not


def test_bench_speed_out_of_a_hybrid_and_its_errors(dirs, kvlingo_home):
    result = _bench(dirs["gdn"], dirs["qwen"], "--lengths", "24", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["routes"] == ["translated"]
    result = _bench(dirs["gdn"], dirs["gdn"], "--lengths", "24", "--translator", "identity")
    assert result.exit_code == 2 and "translators for hybrid caches have no artifact yet" in result.output
    result = _bench(dirs["qwen"], dirs["gdn"], "--lengths", "4096")
    assert result.exit_code == 2 and "exceed the 128 positions" in result.output, result.output
