"""`kvlingo eval` on tiny local models: harness sanity (identity translation == native on every metric),
the JSON contract, and clear errors."""

import json
import socket

import pytest
from tiny_configs import save_tiny_model_dir
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(save_tiny_model_dir("qwen3", tmp_path_factory.mktemp("eval") / "qwen3"))


def run(*args):
    return runner.invoke(app, ["eval", *args, "--json"])


def test_identity_translation_equals_native_on_every_metric(qwen_dir, kvlingo_home):
    result = run(qwen_dir, qwen_dir, "--translator", "identity", "--limit", "3", "--benchmark", "corpus_kl",
                 "--benchmark", "recall", "--benchmark", "ruler_noise", "--ruler-lengths", "24,40",
                 "--benchmark", "switch_quality")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    rows = {(r["benchmark"], r["condition"]): r for r in out["rows"]}
    benchmarks = {b for b, _ in rows}
    assert benchmarks == {"corpus_kl", "recall", "ruler_noise_24", "ruler_noise_40", "switch_quality"}
    for bench in benchmarks:
        native, identity = rows[(bench, "target_native")], rows[(bench, "identity")]
        for key in ("benchmark", "condition", "score", "se", "n"):
            assert key in identity  # public contract
        assert identity["n"] == native["n"] > 0
        assert identity["score"] == pytest.approx(native["score"], abs=1e-6)
        assert identity["ci_low"] is not None and identity["ci_high"] is not None
    assert rows[("corpus_kl", "identity")]["score"] <= 1e-6
    assert rows[("switch_quality", "identity")]["score"] == 1.0  # the identity switch keeps the continuation


def test_unknown_benchmark_and_missing_data_are_reported_before_loading(qwen_dir, kvlingo_home, tmp_path):
    result = run(qwen_dir, qwen_dir, "--translator", "identity", "--benchmark", "rulr_noise", "--benchmark", "mmlu_pro",
                 "--data-dir", str(tmp_path))
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "did you mean 'ruler_noise'" in err
    assert f"missing {tmp_path}/mmlu_pro/test.jsonl.gz" in err


def test_no_translator_to_evaluate_says_what_to_do(qwen_dir, kvlingo_home):
    result = run(qwen_dir, qwen_dir, "--benchmark", "recall")
    assert result.exit_code == 2 and "kvlingo fit" in result.stderr


def test_judge_endpoint_down_keeps_other_results(qwen_dir, kvlingo_home, tmp_path):
    mt = tmp_path / "mt_bench"
    (mt / "reference_answer").mkdir(parents=True)
    (mt / "question.jsonl").write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["w1 w2", "w3"]}) + "\n")
    (mt / "reference_answer" / "gpt-4.jsonl").write_text("")
    template = {"name": "single-v1", "type": "single", "system_prompt": "judge",
                "prompt_template": "[Question]\n{question}\n[Answer]\n{answer}", "output_format": "[[rating]]"}
    math = {**template, "name": "single-math-v1", "prompt_template": template["prompt_template"] + "\n{ref_answer_1}"}
    (mt / "judge_prompts.jsonl").write_text(json.dumps(template) + "\n" + json.dumps(math) + "\n")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run(qwen_dir, qwen_dir, "--translator", "identity", "--limit", "2", "--benchmark", "recall",
                 "--benchmark", "mt_bench_judge", "--data-dir", str(tmp_path), "--judge-url", f"http://127.0.0.1:{port}/v1",
                 "--judge-model", "judge")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {r["benchmark"] for r in out["rows"]} == {"recall"}
    assert out["errors"][0]["benchmark"] == "mt_bench_judge" and f"127.0.0.1:{port}" in out["errors"][0]["error"]
