"""`kvlingo doctor`: the JSON contract, exit codes, and clear errors (tiny local models, in-process)."""

import json

import pytest
from tiny_configs import save_tiny_model_dir, words
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return str(save_tiny_model_dir("gemma3", tmp_path_factory.mktemp("gemma")))


def test_doctor_json_contract(gemma_dir):
    result = runner.invoke(app, ["doctor", gemma_dir, "--prompt", words(24), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(report["points"]) == {"pre_norm", "post_norm", "post_rope"}
    for row in report["points"].values():
        assert isinstance(row["max_abs_logit_diff"], float) and row["max_abs_logit_diff"] <= 1e-4
        assert row["grad_ok"] is True
    assert report["ok"] is True and report["model"] == gemma_dir


def test_doctor_single_point_and_failing_tolerance_exit_1(gemma_dir):
    result = runner.invoke(app, ["doctor", gemma_dir, "--point", "post_rope", "--prompt", words(8), "--tolerance", "0", "--json"])
    report = json.loads(result.stdout)
    assert list(report["points"]) == ["post_rope"]
    # A zero tolerance fails unless the two paths agree bit for bit; the exit code must follow "ok".
    assert result.exit_code == (0 if report["ok"] else 1)


@pytest.mark.parametrize(
    "args, message",
    [
        (["doctor", "smollm2-135m-instrct"], "did you mean 'smollm2-135m-instruct'"),
        (["doctor", "someorg/not-downloaded"], "HF_HUB_OFFLINE"),
        (["doctor", "{gemma}", "--point", "post_nrm"], "did you mean 'post_norm'"),
        (["doctor", "{gemma}", "--prompt", "{long}"], "200 tokens but the model"),
    ],
)
def test_doctor_bad_input_exits_2_with_message(gemma_dir, args, message):
    args = [a.replace("{gemma}", gemma_dir).replace("{long}", words(200)) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_models_lists_zoo():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and "gemma3-270m" in result.stdout and "kvlingo-tiny-s" in result.stdout
