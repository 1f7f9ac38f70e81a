"""The benchmark registry (evals/benchmarks/): adding a module adds a benchmark everywhere (preflight, `kvlingo
eval --benchmark`, the suites, the fit flow's benchmarks); the data-free suite is the default without a data
folder; the README table lists every benchmark; the empty-prefix condition is the fit's `empty_prefix` control."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_configs import save_tiny_model_dir, tiny_model, words
from typer.testing import CliRunner

import evals.benchmarks
from evals.benchmarks import SUITES, all_specs, default_suite, get, markdown_table, suite
from flows.cli import app
from tasks.evaluate import EvalConfig, preflight, rows_for
from translators.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

# A benchmark written by a user: one module, nothing else edited. Its items are fixed token sequences; the score
# is the log-probability of a fixed next token under the condition (condition-dependent, identity == native).
TOY_MODULE = '''
from evals.benchmarks import BenchmarkSpec


def run(context, condition, limit):
    from evals.conditions import continuation_logprobs

    return {f"toy{i}": float(continuation_logprobs(condition, [3 + i, 5, 7 + i, 11], [13 + i]).sum())
            for i in range(limit)}


SPEC = BenchmarkSpec(name="toy_bench", suites=("data_free", "quick", "full"), metric="log p(next), nats",
                     higher_is_better=True, run=run, description="a toy added at runtime")
'''


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return str(save_tiny_model_dir("qwen3", tmp_path_factory.mktemp("registry") / "qwen3"))


@pytest.fixture
def toy_benchmark(tmp_path, monkeypatch):
    """`toy_bench` registered by dropping one module into a folder on the benchmark package's path."""
    folder = tmp_path / "more_benchmarks"
    folder.mkdir()
    (folder / "toy_bench.py").write_text(TOY_MODULE)
    monkeypatch.setattr(evals.benchmarks, "__path__", [*evals.benchmarks.__path__, str(folder)])
    yield "toy_bench"
    sys.modules.pop("evals.benchmarks.toy_bench", None)


def test_specs_and_suites():
    specs = all_specs()
    assert {"corpus_kl", "first_token_kl", "recall", "needle"} == set(suite("data_free"))
    for spec in specs.values():
        assert set(spec.suites) <= set(SUITES) and spec.metric and callable(spec.run)
    data_free, quick, full = (set(suite(s)) for s in SUITES)
    assert data_free < quick < full == set(specs)
    assert all(not specs[n].required_files for n in data_free)  # data-free means no files
    assert {n for n in quick - data_free if specs[n].required_files} == {"mmlu_pro", "arc_challenge", "gsm8k",
                                                                        "xquad_multiturn"}
    # Each lm-eval benchmark declares its own metric and filter, not one picked by name elsewhere.
    assert "strict-match" in get("gsm8k").metric and "acc" in get("arc_challenge").metric
    assert default_suite(None) == "data_free" and default_suite("/data") == "quick"
    assert EvalConfig(source="a", target="b").selected() == suite("data_free")
    assert EvalConfig(source="a", target="b", data_dir="/d").selected() == suite("quick")
    with pytest.raises(ConfigError, match="did you mean 'quick'"):
        suite("quik")


def test_readme_table_is_generated_from_the_specs():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- benchmarks:start -->\n", 1)[1].split("\n<!-- benchmarks:end -->", 1)[0]
    listed = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert listed == list(all_specs()), "README benchmark table out of date: paste `python -m evals.benchmarks`"
    assert table == markdown_table()


def test_a_module_without_spec_is_refused(tmp_path, monkeypatch):
    (tmp_path / "half_done.py").write_text("def run(context, condition, limit):\n    return {}\n")
    monkeypatch.setattr(evals.benchmarks, "__path__", [*evals.benchmarks.__path__, str(tmp_path)])
    try:
        with pytest.raises(ConfigError, match="half_done defines no SPEC"):
            all_specs()
    finally:
        sys.modules.pop("evals.benchmarks.half_done", None)


def test_preflight_defaults_and_messages(tmp_path):
    # No data folder: the data-free suite needs nothing; asking for the quick suite names the real option.
    preflight(EvalConfig(source="kvlingo-tiny-l", target="kvlingo-tiny-s"))
    with pytest.raises(ConfigError) as err:
        preflight(EvalConfig(source="kvlingo-tiny-l", target="kvlingo-tiny-s", suite="quick"))
    text = str(err.value)
    assert "mmlu_pro reads local files: pass --data-dir" in text and "--benchmarks" not in text
    with pytest.raises(ConfigError) as err:
        preflight(EvalConfig(source="kvlingo-tiny-l", target="kvlingo-tiny-s", data_dir=tmp_path))
    text = str(err.value)
    assert f"missing {tmp_path}/gsm8k/test.jsonl" in text and "--benchmark NAME" in text
    assert "--benchmarks" not in text


def test_toy_module_appears_in_suite_preflight_eval_and_fit(toy_benchmark, qwen_dir, kvlingo_home, monkeypatch):
    assert toy_benchmark in suite("data_free") and toy_benchmark in suite("full")
    assert toy_benchmark in markdown_table()
    # preflight: known by name, and the registry's suggestions include it
    specs = preflight(EvalConfig(source=qwen_dir, target=qwen_dir, benchmarks=[toy_benchmark]))
    assert [s.name for s in specs] == [toy_benchmark]
    with pytest.raises(ConfigError, match="did you mean 'toy_bench'"):
        preflight(EvalConfig(source=qwen_dir, target=qwen_dir, benchmarks=["toy_bnech"]))

    # `kvlingo eval --benchmark toy_bench`
    result = runner.invoke(app, ["eval", qwen_dir, qwen_dir, "--translator", "identity", "--limit", "3",
                                 "--benchmark", toy_benchmark, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["conditions"] == ["target_native", "source_native", "empty_prefix", "identity"]
    rows = {r["condition"]: r for r in out["rows"]}
    assert {r["benchmark"] for r in out["rows"]} == {toy_benchmark}
    assert all(r["n"] == 3 and r["extra"]["metric"] == "log p(next), nats" for r in rows.values())
    assert rows["identity"]["score"] == pytest.approx(rows["target_native"]["score"], abs=1e-5)
    # the empty prefix reads only the last token: a different number, paired against target native
    assert abs(rows["empty_prefix"]["score"] - rows["target_native"]["score"]) > 1e-3
    assert rows["empty_prefix"]["ci_low"] is not None and rows["source_native"]["ci_low"] is None

    # the default suite (no --benchmark, no --data-dir) runs it beside the built-in data-free benchmarks
    result = runner.invoke(app, ["eval", qwen_dir, qwen_dir, "--translator", "identity", "--limit", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["suite"] == "data_free"
    assert [b["name"] for b in out["benchmarks"]] == suite("data_free")
    assert {"corpus_kl", "first_token_kl", toy_benchmark} <= {r["benchmark"] for r in out["rows"]}
    for row in out["rows"]:
        assert row["se"] >= 0 and row["n"] > 0

    # the fit flow's benchmarks come from the same registry
    import flows.pipeline

    seen = {}
    monkeypatch.setattr(flows.pipeline, "eval_task", lambda config: seen.setdefault("config", config) and {"rows": []})
    flows.pipeline._benchmarks(SimpleFit(qwen_dir), Path("/nonexistent"), 2, None, [64])
    assert toy_benchmark in seen["config"].selected() and seen["config"].selected() == suite("data_free")


class SimpleFit:
    """The FitConfig fields `_benchmarks` reads: the pair and the one-process switch."""

    def __init__(self, model):
        self.source = self.target = model
        self.workers, self.ray_address = 1, None


def test_row_groups_give_one_row_per_group():
    spec = get("ruler_noise")
    per_condition = {"target_native": {"256/0": 1.0, "256/1": 0.0, "512/2": 1.0, "512/3": 1.0},
                     "closed_form": {"256/0": 1.0, "256/1": 1.0, "512/2": 0.0, "512/3": 1.0}}
    rows = rows_for(spec.name, per_condition, spec=spec)
    assert [(r["benchmark"], r["condition"], r["n"]) for r in rows] == [
        ("ruler_noise_256", "target_native", 2), ("ruler_noise_256", "closed_form", 2),
        ("ruler_noise_512", "target_native", 2), ("ruler_noise_512", "closed_form", 2)]
    assert rows[1]["extra"]["delta"] == pytest.approx(0.5) and rows[1]["extra"]["higher_is_better"] is True


def test_empty_prefix_is_the_fits_control():
    from evals.conditions import continuation_logits, empty_prefix, greedy_generate, target_native
    from translators.continuation import no_prefix_logits
    from translators.layout import cache_layout
    from translators.stage1 import Side

    model = tiny_model("qwen3")
    side = Side(model, cache_layout(model))
    ids = torch.tensor([int(w[1:]) for w in words(12, seed=3).split()])
    prefix, continuation = ids[:9], ids[9:]
    floor = empty_prefix(side)
    assert torch.allclose(continuation_logits(floor, prefix, continuation),
                          no_prefix_logits(model, prefix, continuation), atol=1e-5)
    assert greedy_generate(floor, prefix, 4) == greedy_generate(target_native(side), prefix[-1:], 4)
    assert not torch.allclose(continuation_logits(floor, prefix, continuation),
                              continuation_logits(target_native(side), prefix, continuation), atol=1e-3)
    with pytest.raises(ConfigError, match="no translated cache"):
        type(floor)("empty_prefix", decoder=side, source=side)


def test_needle_items_use_the_embedded_chat_format():
    from evals.benchmarks.needle import DEPTHS, needle_items

    items = needle_items(6, seed=0)
    assert items == needle_items(6, seed=0)  # deterministic
    assert [i.depth for i in items] == [DEPTHS[k % 3] for k in range(6)]
    for item in items:
        roles = [m["role"] for m in item.messages]
        assert roles[-1] == "user" and roles[:-1] == ["user", "assistant"] * (len(roles) // 2)
        assert item.messages[-1]["content"] == f"What is the code for {item.key}?"
        statement = f"The code for {item.key} is {item.gold}."
        said = [k for k, m in enumerate(item.messages) if statement in m["content"]]
        assert len(said) == 2 and said[1] == said[0] + 1  # stated, then echoed, as in the training corpus
        assert sum(item.key.split("-")[0] in m["content"] for m in item.messages[:-1]) == 2  # key not in the haystack


def test_benchmark_modules_import_no_orchestration_or_tracking():
    code = textwrap.dedent("""
        import sys
        from evals.benchmarks import all_specs
        assert len(all_specs()) >= 11
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("prefect", "ray", "mlflow"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""
