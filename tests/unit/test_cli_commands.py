"""CLI contracts across commands: help texts, exit codes (1 divergence, 2 bad input), --gpu validation, and
`bench multiturn` with translator references."""

import errno
import json
import typing

import pytest
import torch
from tiny_configs import save_tiny_model_dir
from typer.testing import CliRunner

import flows.fit
from flows.cli import _fail, app
from translators.errors import NonFiniteError

runner = CliRunner()


def flat(text: str) -> str:
    """Help output with rich's wrapping and box characters collapsed to single spaces."""
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir("qwen3", tmp_path_factory.mktemp("cli") / "qwen3", max_position_embeddings=512))


def test_bench_help_lists_every_benchmark():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    text = flat(result.stdout)
    assert "hand-off benchmarks" in text and "multi-turn hand-offs (multiturn)" in text
    for command in ("speed", "step", "multiturn"):
        assert f" {command} " in text
    result = runner.invoke(app, ["bench", "multiturn", "--help"])
    assert result.exit_code == 0 and "--translator-ab" in result.stdout and "--translator-ba" in result.stdout


def test_ui_help():
    result = runner.invoke(app, ["ui", "--help"])
    assert result.exit_code == 0, result.output
    text = flat(result.stdout)
    assert "MLflow UI" in text and "--port" in text and "--host" in text


def test_fail_never_returns():
    assert typing.get_type_hints(_fail)["return"] is typing.NoReturn


def test_divergence_exits_1_with_the_message(model_dir, kvlingo_home, monkeypatch):
    def diverge(config):
        raise NonFiniteError("stage 2 loss is nan at step 3: stopped; the last good checkpoint is kept")

    monkeypatch.setattr(flows.fit, "run_fit", diverge)
    result = runner.invoke(app, ["fit", model_dir, model_dir, "--steps", "3", "--json"])
    assert result.exit_code == 1, result.output
    assert "loss is nan at step 3" in flat(result.stderr) and result.stdout == ""


def test_a_full_disk_exits_1_naming_the_store_and_how_to_free_it(model_dir, kvlingo_home, monkeypatch):
    shard = kvlingo_home / "stats" / "abc"
    shard.mkdir(parents=True)
    (shard / "keys.safetensors").write_bytes(b"x" * 3_000_000)

    def disk_full(config):
        raise OSError(errno.ENOSPC, "No space left on device", str(kvlingo_home / "runs" / "optimizer.safetensors"))

    monkeypatch.setattr(flows.fit, "run_fit", disk_full)
    result = runner.invoke(app, ["fit", model_dir, model_dir, "--json"])
    assert result.exit_code == 1, result.output
    message = flat(result.stderr)
    assert "no space left on the device writing" in message and "optimizer.safetensors" in message
    assert f"{kvlingo_home / 'stats'} holds 0.0 GB in 1 shard(s)" in message
    assert "kvlingo stats-store prune --max-gb G" in message and result.stdout == ""


def test_other_os_errors_of_a_fit_are_not_relabelled(model_dir, kvlingo_home, monkeypatch):
    def denied(config):
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere")

    monkeypatch.setattr(flows.fit, "run_fit", denied)
    result = runner.invoke(app, ["fit", model_dir, model_dir, "--json"])
    assert isinstance(result.exception, PermissionError)


def test_gpu_needs_workers(model_dir, kvlingo_home):
    result = runner.invoke(app, ["fit", model_dir, model_dir, "--gpu", "--json"])
    assert result.exit_code == 2, result.output
    assert "gpu places Ray Train workers on GPUs: set workers > 1" in flat(result.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_needs_cuda(model_dir, kvlingo_home):
    result = runner.invoke(app, ["fit", model_dir, model_dir, "--gpu", "--workers", "2", "--json"])
    assert result.exit_code == 2, result.output
    assert "gpu needs a CUDA device" in flat(result.stderr)


def test_multiturn_with_identity_references(model_dir, kvlingo_home):
    """Copies of one model with identity translators: translating reproduces re-prefilling exactly."""
    result = runner.invoke(app, ["bench", "multiturn", model_dir, model_dir, "--translator-ab", "identity",
                                 "--translator-ba", "identity", "--conversations", "1", "--turns", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["translators"] == {"ab": "identity", "ba": "identity"}
    assert out["modes"]["segment"]["per_turn"] == out["modes"]["reprefill"]["per_turn"]
    assert out["modes"]["segment"]["max_times_a_span_was_translated"] == 1


@pytest.mark.parametrize("args, message", [
    (["--translator-ab", "identity", "--fit-dir-ab", "/tmp"], "give --translator-ab or --fit-dir-ab, not both"),
    (["--translator-ab", "models:/x@"], "is not a valid registry URI"),
    (["--translator-ba", "/nonexistent"], "no such directory"),
])
def test_multiturn_bad_references_exit_2(model_dir, kvlingo_home, args, message):
    result = runner.invoke(app, ["bench", "multiturn", model_dir, model_dir, *args, "--json"])
    assert result.exit_code == 2, result.output
    assert message in flat(result.stderr)
