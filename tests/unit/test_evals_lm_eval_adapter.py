"""Evaluation conditions and the lm-eval adapter on tiny random-init models with the word-level tokenizer."""

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tiny_configs import tiny_model, tiny_tokenizer, words

from evals.conditions import (
    Condition,
    continuation_logprobs,
    greedy_generate,
    source_native,
    target_native,
    translated,
)
from evals.lm_eval_adapter import KvlingoLM, cut_at_stop, register
from evals.lm_eval_tasks import materialise_tasks, run_lm_eval
from translators.errors import ConfigError, PairMismatchError
from translators.layout import cache_layout
from translators.stage1 import Side
from translators.translator import Translator

REPO = Path(__file__).resolve().parents[2]


def side(family: str, seed: int = 0) -> Side:
    model = tiny_model(family, seed)
    return Side(model, cache_layout(model))


@pytest.fixture(scope="module")
def llama() -> Side:
    return side("llama")


@pytest.fixture(scope="module")
def gemma() -> Side:
    return side("gemma3")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def ll_request(context: str, continuation: str) -> Instance:
    return Instance("loglikelihood", {}, (context, continuation), 0)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def direct_logprob(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """Reference: one plain forward over everything, log_softmax, gather the continuation's tokens."""
    ids = torch.tensor(context_ids + continuation_ids).view(1, -1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [n + m, vocab]
    n, m = len(context_ids), len(continuation_ids)
    rows = logprobs[n - 1 : n + m - 1]  # predictions for the continuation tokens
    target = torch.tensor(continuation_ids)
    return float(rows.gather(-1, target.view(-1, 1)).sum()), bool((rows.argmax(-1) == target).all())


def identity_translator(layout) -> Translator:
    """A real Translator whose maps are identities (layer ℓ reads source layer ℓ)."""
    band = {layer: (layer,) for layer in range(layout.n_layers)}
    translator = Translator({"keys": band, "values": band}, layout.kv_width, layout.kv_width, "post_norm")
    for s in ("keys", "values"):
        for layer in range(layout.n_layers):
            translator.set_weight(s, layer, torch.eye(layout.kv_width))
    return translator


# ---- conditions ------------------------------------------------------------------------------------------


def test_condition_validation(llama, gemma):
    with pytest.raises(ConfigError, match="unknown condition"):
        Condition("translate", decoder=llama)
    with pytest.raises(ConfigError, match="no source and no translator"):
        Condition("target_native", decoder=llama, source=llama)
    with pytest.raises(ConfigError, match="needs the source"):
        Condition("translated", decoder=llama)
    with pytest.raises(PairMismatchError, match="copies of one model"):
        translated(llama, gemma)
    wrong = identity_translator(gemma.layout)
    with pytest.raises(PairMismatchError, match="does not fit"):
        translated(llama, llama, wrong)


def test_translated_identity_matches_target_native_on_sliding_window_model(gemma):
    # 14 context tokens > the tiny Gemma's window of 6: the injected sliding layers keep only their window.
    context, continuation = torch.arange(2, 16), torch.tensor([20, 30, 40, 50])
    native = continuation_logprobs(target_native(gemma), context, continuation)
    for translator in (None, identity_translator(gemma.layout)):
        got = continuation_logprobs(translated(gemma, gemma, translator), context, continuation)
        assert got.shape == (4,)
        torch.testing.assert_close(got, native, atol=1e-5, rtol=0)


def test_source_native_uses_the_source_model(llama):
    other = side("llama", seed=1)
    context, continuation = torch.arange(2, 12), torch.tensor([20, 30])
    a = continuation_logprobs(target_native(llama), context, continuation)
    b = continuation_logprobs(source_native(other), context, continuation)
    assert (a - b).abs().max() > 1e-3


def test_greedy_generate_matches_naive_loop_and_stops_at_stop_ids(llama, gemma):
    for s in (llama, gemma):
        context = torch.arange(3, 13)
        ids = context.clone()
        naive = []
        with torch.no_grad():
            for _ in range(6):
                token = int(s.model(input_ids=ids.view(1, -1)).logits[0, -1].argmax())
                naive.append(token)
                ids = torch.cat([ids, torch.tensor([token])])
        assert greedy_generate(target_native(s), context, 6) == naive
        assert greedy_generate(translated(s, s), context, 6) == naive
        stop = naive[3]
        # One decoder, one stop semantics (translators.generation): the stop id is returned as the last token.
        assert greedy_generate(target_native(s), context, 6, {stop}) == naive[: naive.index(stop) + 1]
    with pytest.raises(ConfigError):
        greedy_generate(target_native(llama), torch.tensor([], dtype=torch.long), 4)


# ---- lm-eval adapter -------------------------------------------------------------------------------------


def test_loglikelihood_equals_direct_forward(llama, tokenizer):
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    pairs = [("w1 w2 w3 w4", " w5 w6"), ("w10 w11 w12 ", "w13"), ("w7 w8", " w9 w20 w30")]
    results = lm.loglikelihood([ll_request(c, x) for c, x in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        # The trailing space moved to the continuation tokenises away in a word-level tokenizer.
        expected = direct_logprob(llama.model, encode(tokenizer, context), encode(tokenizer, continuation))
        assert logprob == pytest.approx(expected[0], abs=1e-5)
        assert greedy == expected[1]


def test_loglikelihood_empty_context_conditions_on_eos(llama, tokenizer):
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    (logprob, _), = lm.loglikelihood([ll_request("", "w3 w4")])
    assert logprob == pytest.approx(direct_logprob(llama.model, [tokenizer.eos_token_id], [5, 6])[0], abs=1e-5)


def test_is_greedy_true_for_the_greedy_continuation(llama, tokenizer):
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    greedy_text = lm.generate_text("w1 w2 w3", [], 3)
    (_, is_greedy), = lm.loglikelihood([ll_request("w1 w2 w3", " " + greedy_text)])
    assert is_greedy


def test_translated_identity_loglikelihood_equals_target_native(llama, tokenizer):
    requests = [ll_request(words(12, seed=i), " " + words(3, seed=10 + i)) for i in range(3)]
    native = KvlingoLM(target_native(llama), tokenizer, show_progress=False).loglikelihood(requests)
    ident = KvlingoLM(translated(llama, llama), tokenizer, show_progress=False).loglikelihood(requests)
    for (a, ga), (b, gb) in zip(native, ident):
        # fp32 rounding, relative to the size of the sum: the translated condition scores the continuation over
        # an injected cache, target-native in its own forward (measured 1.05e-5 at -14.26 on one thread)
        assert b == pytest.approx(a, abs=1e-5, rel=2e-6)
        assert ga == gb


def test_loglikelihood_rolling_scores_every_token_once(llama, tokenizer):
    text = words(20, seed=3)
    tokens = encode(tokenizer, text)
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    full = KvlingoLM(target_native(llama), tokenizer, show_progress=False).loglikelihood_rolling([request])[0]
    assert full == pytest.approx(direct_logprob(llama.model, [tokenizer.eos_token_id], tokens)[0], abs=1e-4)
    short = KvlingoLM(target_native(llama), tokenizer, max_length=8, show_progress=False)
    windowed = short.loglikelihood_rolling([request])[0]
    reference = sum(
        direct_logprob(llama.model, ctx, pred)[0]
        for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(tokens, tokenizer.eos_token_id, 8, 1))
    )
    assert windowed == pytest.approx(reference, abs=1e-4)
    assert windowed != pytest.approx(full, abs=1e-3)  # the windows really cut the context


def test_generate_until_cuts_before_the_first_stop_string(llama, tokenizer):
    lm = KvlingoLM(target_native(llama), tokenizer, max_gen_toks=6, show_progress=False)
    context = words(10, seed=5)
    free = lm.generate_until([Instance("generate_until", {}, (context, {"until": []}), 0)])[0]
    generated = free.split()
    assert len(generated) == 6
    stop = generated[2]
    gen_kwargs = {"until": [stop, "w96"], "max_gen_toks": 6}
    cut = lm.generate_until([Instance("generate_until", {}, (context, gen_kwargs), 0)])[0]
    assert stop not in cut
    assert cut == free[: free.index(stop)]
    assert cut.split() == generated[: len(cut.split())] and len(cut.split()) <= 2
    assert cut_at_stop("a b c", ["c", "b"]) == "a "


def test_generation_arguments_are_checked(llama, tokenizer):
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    with pytest.raises(ConfigError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, ("w1", {"do_sample": True}), 0)])
    with pytest.raises(ConfigError, match="no room"):
        lm.generate_until([Instance("generate_until", {}, ("w1", {"max_gen_toks": 500}), 0)])
    with pytest.raises(ConfigError, match="batch_size=1"):
        KvlingoLM(target_native(llama), tokenizer, batch_size=8)
    with pytest.raises(ConfigError, match="max_length"):
        KvlingoLM(target_native(llama), tokenizer, max_length=10_000)


def test_register_is_explicit_and_idempotent():
    # A fresh interpreter: importing the adapter must not register it; register() must.
    probe = (
        "from lm_eval.api.registry import model_registry as r\n"
        "import evals.lm_eval_adapter as a\n"
        "before = 'kvlingo' in r\n"
        "a.register(); a.register()\n"
        "print(before, r.get('kvlingo') is a.KvlingoLM)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    assert register().__name__ == "KvlingoLM"


# ---- end to end through lm-eval ------------------------------------------------------------------------------

ITEMS = [
    {"query": "w1 w2 w3", "choices": ["w4 w5", "w6", "w7 w8 w9"], "gold": 0},
    {"query": "w10 w11", "choices": ["w12", "w13 w14"], "gold": 1},
    {"query": "w20 w21 w22 w23", "choices": ["w24", "w25", "w26"], "gold": 2},
    {"query": "w30", "choices": ["w31 w32", "w33"], "gold": 0},
    {"query": "w40 w41", "choices": ["w42", "w43", "w44", "w45"], "gold": 3},
    {"query": "w50 w51 w52", "choices": ["w53", "w54"], "gold": 1},
]


def write_mc_task(root: Path) -> Path:
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (root / "tiny_mc.yaml").write_text(
        "task: kvlingo_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {root / 'cache'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{query}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


def test_simple_evaluate_end_to_end_on_a_local_yaml(llama, tokenizer, tmp_path):
    include = write_mc_task(tmp_path)
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    result = run_lm_eval(lm, ["kvlingo_tiny_mc"], include, limit=4, per_item=True)["kvlingo_tiny_mc"]
    assert result["n"] == 4 and 0.0 <= result["acc"] <= 1.0
    # The harness's accuracy is the argmax of our own log-likelihoods over the first four items.
    expected = []
    for item in ITEMS[:4]:
        scores = [lp for lp, _ in lm.loglikelihood([ll_request(item["query"], " " + c) for c in item["choices"]])]
        expected.append(float(max(range(len(scores)), key=scores.__getitem__) == item["gold"]))
    assert result["acc"] == pytest.approx(sum(expected) / 4)
    assert [item["acc"] for item in sorted(result["items"], key=lambda i: i["doc_id"])] == expected
    # tasks.evaluate pairs conditions by doc id under the filter "none" for tasks without a filter list.
    assert sorted(item["doc_id"] for item in result["items"]) == [0, 1, 2, 3]
    assert {item["filter"] for item in result["items"]} == {"none"}


def test_run_lm_eval_rejects_unknown_tasks(llama, tokenizer, tmp_path):
    lm = KvlingoLM(target_native(llama), tokenizer, show_progress=False)
    with pytest.raises(ConfigError, match="materialise_tasks"):
        run_lm_eval(lm, ["kvlingo_nope"], tmp_path, limit=1)


# ---- task materialisation (synthetic files in the real schemas; the real data is the integration tier's) --------


def write_fake_data(root: Path) -> Path:
    (root / "mmlu_pro").mkdir(parents=True)
    (root / "arc_challenge").mkdir()
    (root / "gsm8k").mkdir()
    mmlu = {"question": "Q?", "options": ["a", "b", "c"], "answer": "C", "answer_index": 2, "category": "law"}
    with gzip.open(root / "mmlu_pro" / "test.jsonl.gz", "wt") as f:
        f.write((json.dumps(mmlu) + "\n") * 5)
    # The hub export's ARC shape (question string, choices of lists) is accepted under arc_challenge/test.jsonl.
    arc = {"question": "Why?", "choices": {"text": ["x", "y"], "label": ["1", "2"]}, "answerKey": "2"}
    (root / "arc_challenge" / "test.jsonl").write_text((json.dumps(arc) + "\n") * 5)
    gsm = {"question": "1+1?", "answer": "It is 2.\n#### 1,002"}
    (root / "gsm8k" / "test.jsonl").write_text((json.dumps(gsm) + "\n") * 5)
    return root


def test_materialise_tasks_points_yamls_at_the_data_dir(tmp_path):
    data = write_fake_data(tmp_path / "data")
    paths = materialise_tasks(data, tmp_path / "tasks")
    assert sorted(paths) == ["kvlingo_arc_challenge", "kvlingo_gsm8k", "kvlingo_mmlu_pro"]
    config = yaml.safe_load(paths["kvlingo_mmlu_pro"].read_text())
    assert config["task"] == "kvlingo_mmlu_pro" and config["dataset_path"] == "json"
    assert config["dataset_kwargs"]["data_files"]["test"] == str((data / "mmlu_pro" / "test.jsonl.gz").resolve())
    assert Path(config["include"]).is_file()
    arc = yaml.safe_load(paths["kvlingo_arc_challenge"].read_text())
    assert arc["dataset_kwargs"]["data_files"]["test"].endswith("arc_challenge/test.jsonl")

    subset = materialise_tasks(data, tmp_path / "subset", limit=2)
    data_file = Path(yaml.safe_load(subset["kvlingo_gsm8k"].read_text())["dataset_kwargs"]["data_files"]["test"])
    assert data_file.parent == (tmp_path / "subset" / "data").resolve()
    assert len(data_file.read_text().splitlines()) == 2

    with pytest.raises(ConfigError, match="positive integer"):
        materialise_tasks(data, tmp_path / "x", limit=0)
    with pytest.raises(ConfigError, match="unknown local task"):
        materialise_tasks(data, tmp_path / "x", tasks=["kvlingo_mmlu"])


def test_task_prompt_functions_on_both_arc_shapes():
    spec = importlib.util.spec_from_file_location("kvlingo_task_utils", REPO / "evals" / "tasks" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    choices = [{"text": "x", "label": "A"}, {"text": "y", "label": "B"}]
    nested = {"question": {"stem": "Why?", "choices": choices}, "answerKey": "B"}
    flat = {"question": "Why?", "choices": {"text": ["x", "y"], "label": ["1", "2"]}, "answerKey": "2"}
    for doc in (nested, flat):
        assert utils.arc_text(doc) == "Question: Why?\nAnswer:"
        assert (utils.arc_choices(doc), utils.arc_target(doc)) == (["x", "y"], 1)
    mmlu = {"question": "Q?", "options": ["a", "b", "c"], "answer_index": 2, "category": "computer_science"}
    assert utils.mmlu_pro_text(mmlu).endswith("Q?\nA. a\nB. b\nC. c\nAnswer:")
    assert "computer science" in utils.mmlu_pro_text(mmlu)
    assert utils.mmlu_pro_choices(mmlu) == ["A", "B", "C"]
    assert utils.gsm8k_target({"answer": "so\n#### 1,002"}) == "1002"
