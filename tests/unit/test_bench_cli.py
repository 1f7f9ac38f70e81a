"""`kvlingo bench speed` on tiny local models: the JSON contract, the FLOP model, clear errors."""

import json

import pytest
from tiny_configs import save_tiny_model_dir, tiny_model
from typer.testing import CliRunner

from evals.speed import FlopModel, flop_model
from flows.cli import app
from translators.layout import cache_layout

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return {"qwen": str(save_tiny_model_dir("qwen3", root / "qwen3")), "llama": str(save_tiny_model_dir("llama", root / "llama"))}


def bench(*args):
    return runner.invoke(app, ["bench", "speed", *args])


def test_json_contract_same_model(dirs, kvlingo_home):
    result = bench(dirs["qwen"], dirs["qwen"], "--lengths", "16,32", "--repeats", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # exactly one JSON object on stdout
    rows = report["rows"]
    assert [r["n"] for r in rows] == [16, 32]
    for row in rows:
        for key in ("switch_s", "prefill_s", "ratio", "flop_ratio"):
            assert isinstance(row[key], float) and row[key] > 0, key
        assert row["ratio"] == pytest.approx(row["prefill_s"] / row["switch_s"])
        assert row["flop_ratio"] == pytest.approx(row["prefill_flops"] / (row["map_flops"] + row["step_flops"]))
        # Dense identity maps: 2 sides × 3 layers × 2·d² FLOPs per token, d = 2 heads × 16.
        assert row["map_flops"] == 2 * 3 * 2 * 32 * 32 * (row["n"] - 1)
        assert row["first_token_match"] is True  # the identity switch picks the re-prefill's token
        assert row["switch_decode_tok_s"] > 0 and row["native_decode_tok_s"] > 0
    assert "identity" in report["translator"] and report["threads"] >= 1


def test_cross_model_pair_fits_a_quick_closed_form(dirs, kvlingo_home):
    result = bench(dirs["qwen"], dirs["llama"], "--lengths", "24", "--repeats", "1", "--decode-tokens", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "closed form" in report["translator"] and report["rows"][0]["n"] == 24


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "16,abc"], "comma-separated integers"),
        (["--lengths", "1"], "greater than or equal to 2"),
        (["--lengths", "64,200"], "lengths [200] plus 16 decoded tokens exceed the 128 positions"),
        (["--repeats", "0"], "repeats: Input should be greater than or equal to 1"),
        (["--translator", "/nonexistent"], "translator '/nonexistent': no such directory"),
        (["--translator", "models:/pair@"], "is not a valid registry URI"),
        (["--threads", "0"], "threads: Input should be greater than or equal to 1"),
    ],
)
def test_bad_input_exits_2(dirs, kvlingo_home, args, message):
    result = bench(dirs["qwen"], dirs["qwen"], *args, "--json")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert result.stdout == ""


def test_flop_model_matches_the_formula():
    model = tiny_model("llama")
    flops = flop_model(model, cache_layout(model))
    embeddings = 2 * 97 * 64  # input embedding and untied output head
    assert flops.non_embedding_params == sum(p.numel() for p in model.parameters()) - embeddings
    n, p, layers = 10, flops.non_embedding_params, 3
    assert flops.prefill(n) == 2 * p * n + 4 * 64 * layers * n * (n + 1) // 2 + 2 * 64 * 97
    assert flops.step(n) == 2 * p + 4 * 64 * layers * n + 2 * 64 * 97
    sliding = FlopModel(0, 1, 1, 0, (4,))
    assert sliding.attention(10, causal_sum=True) == 4 * (1 + 2 + 3 + 4 + 4 * 6)
    assert sliding.attention(10, causal_sum=False) == 4 * 4


def test_bench_step_json(tmp_path):
    """`kvlingo bench step`: the distillation step and the baseline are both timed and measured."""
    import json as _json

    from tiny_configs import save_tiny_model_dir
    from typer.testing import CliRunner as _Runner

    from flows.cli import app as _app

    model = str(save_tiny_model_dir("qwen3", tmp_path / "m"))
    result = _Runner().invoke(_app, ["bench", "step", model, model, "--prefix-tokens", "24", "--continuation-tokens", "8",
                                     "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = _json.loads(result.stdout)
    assert set(out["seconds"]) == {"distill_step", "teacher_prefill", "target_fwd_bwd"}
    assert out["time_ratio"] > 0 and out["peak_mb"]["target_fwd_bwd"] > 0


def test_identity_reference_copies_the_source_cache(dirs, kvlingo_home):
    """`--translator identity`: no maps at all (zero map FLOPs), and the switch still picks the re-prefill's token."""
    result = bench(dirs["qwen"], dirs["qwen"], "--lengths", "16", "--repeats", "1", "--decode-tokens", "2",
                   "--translator", "identity", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    row = report["rows"][0]
    assert report["translator"].startswith("identity") and row["map_flops"] == 0 and row["first_token_match"] is True
    assert row["switch_peak_mb"] > 0 and row["prefill_peak_mb"] > 0 and "torch allocations" in report["memory"]


def test_bench_step_takes_a_translator_reference(tmp_path):
    from tiny_configs import save_tiny_model_dir

    model = str(save_tiny_model_dir("qwen3", tmp_path / "m"))
    result = runner.invoke(app, ["bench", "step", model, model, "--prefix-tokens", "16", "--continuation-tokens", "4",
                                 "--repeats", "1", "--translator", "identity", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["translator_parameters"] == 2 * 3 * 32 * 32  # dense identity maps: keys and values, 3 layers, width 32
    result = runner.invoke(app, ["bench", "step", model, model, "--translator", "models:/x", "--json"])
    assert result.exit_code == 2 and "not a valid registry URI" in " ".join(result.stderr.split())
