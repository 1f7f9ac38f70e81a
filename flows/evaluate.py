"""The benchmark suite: the same items scored under every condition, so every delta is paired.

Conditions: `target_native`, `source_native`, and one translated condition per translator: `closed_form` and
`distilled` from the pair's fit directory when present, plus any `--translator` (a path, a registry URI, or
`identity` for a model translated into itself). Translated rows carry the paired bootstrap CI of
(translated − target_native) on the same items: every benchmark returns each condition's scores keyed by item
id, and the pairing keeps the ids both conditions scored (a condition may fail an item the other scored).

Composition only: items, metrics and conditions live in evals/, the numerics in translators/.
"""

from __future__ import annotations

import difflib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from infra.settings import kvlingo_home
from translators.errors import ConfigError

QUICK = ("val_kl", "recall", "ruler_noise", "mmlu_pro", "arc_challenge", "gsm8k", "xquad_multiturn")
FULL = QUICK + ("ruler_essay", "mt_bench_judge")
NEEDS_DATA = {
    "mmlu_pro": "mmlu_pro/test.jsonl.gz",
    "arc_challenge": "arc_challenge/ARC-Challenge-Test_qapredictions_dgem_default.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "xquad_multiturn": "xquad/xquad.en.json",
    "ruler_essay": "ruler/PaulGrahamEssays.json",
    "mt_bench_judge": "mt_bench/question.jsonl",
}
LM_EVAL_TASKS = {"mmlu_pro": "kvlingo_mmlu_pro", "arc_challenge": "kvlingo_arc_challenge", "gsm8k": "kvlingo_gsm8k"}
# The lm-eval filter whose per-item metric is the benchmark's score ("none": the task has no filter list).
LM_EVAL_FILTERS = {"mmlu_pro": "none", "arc_challenge": "none", "gsm8k": "strict-match"}
LM_EVAL_METRICS = {"mmlu_pro": "acc", "arc_challenge": "acc", "gsm8k": "exact_match"}


class EvalConfig(BaseModel):
    """`kvlingo eval`: which pair, which benchmarks, which translators, how many items."""

    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    suite: Literal["quick", "full"] = "quick"
    benchmarks: list[str] | None = Field(None, description="a subset of the suite's benchmarks")
    translators: list[str] = Field(default_factory=list, description="paths, models:/ URIs, or 'identity'")
    fit_dir: Path | None = Field(None, description="where closed_form/ and distilled/ are; default the pair's run dir")
    limit: int = Field(8, ge=1, description="items per benchmark (per length for RULER)")
    data_dir: Path | None = Field(None, description="local benchmark files (MMLU-Pro, ARC, GSM8K, XQuAD, RULER essays, MT-Bench)")
    ruler_lengths: list[int] = Field(default_factory=lambda: [256, 512])
    max_new_tokens: int = Field(24, ge=1)
    judge_url: str | None = Field(None, description="OpenAI-compatible endpoint for the MT-Bench judge")
    judge_model: str | None = Field(None, description="judge model name at the endpoint, or a zoo model for a local judge")
    seed: int = 0

    def selected(self) -> list[str]:
        suite = QUICK if self.suite == "quick" else FULL
        return list(self.benchmarks) if self.benchmarks else list(suite)


def preflight(config: EvalConfig) -> None:
    """Names, data files and judge settings, all checked before any model loads.

    Raises:
        ConfigError: every problem at once (unknown benchmark with suggestions; a missing data file with where it
        looked and how to get it; judge settings missing).
    """
    from infra.zoo import pair_problems

    problems = pair_problems(config.source, config.target)
    for name in config.selected():
        if name not in FULL:
            close = difflib.get_close_matches(name, FULL, n=2, cutoff=0.4)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            problems.append(f"unknown benchmark {name!r}{hint} (available: {', '.join(FULL)})")
            continue
        if name in NEEDS_DATA:
            if config.data_dir is None:
                problems.append(f"{name} reads local files: pass --data-dir (a folder holding {NEEDS_DATA[name]})")
            elif not (Path(config.data_dir) / NEEDS_DATA[name]).is_file():
                problems.append(
                    f"{name}: missing {Path(config.data_dir) / NEEDS_DATA[name]}; put the benchmark's public file there "
                    "(see the README section on offline data) or drop the benchmark with --benchmarks"
                )
    if "mt_bench_judge" in config.selected() and not config.judge_model:
        problems.append("mt_bench_judge needs --judge-model (and --judge-url for an OpenAI-compatible endpoint)")
    if any(n < 8 for n in config.ruler_lengths):
        problems.append("ruler lengths must be ≥ 8 tokens")
    if problems:
        raise ConfigError("cannot start the evaluation:\n  " + "\n  ".join(problems))


# -- conditions ------------------------------------------------------------------------------------------------
def _latest_fit_or_pair_dir(source: str, target: str) -> Path:
    """The newest finished fit of the pair, else the pair's runs folder (which then holds no artifact)."""
    from infra.rundirs import latest_fit_dir, pair_runs_dir

    try:
        return latest_fit_dir(source, target)
    except ConfigError:
        return pair_runs_dir(source, target)


def build_conditions(config: EvalConfig, source, target) -> dict[str, Any]:
    """Condition name → evals.conditions.Condition (translators verified against the loaded pair)."""
    from evals.conditions import source_native, target_native, translated
    from infra.pairs import load_for_pair
    from translators.stage1 import Side

    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    conditions = {"target_native": target_native(tgt), "source_native": source_native(src)}
    fit_dir = Path(config.fit_dir) if config.fit_dir else _latest_fit_or_pair_dir(source.name, target.name)
    for stage in ("closed_form", "distilled"):
        if (fit_dir / stage / "manifest.json").is_file():
            conditions[stage] = translated(src, tgt, load_for_pair(fit_dir / stage, source, target))
    for spec in config.translators:
        if spec == "identity":
            conditions["identity"] = translated(src, tgt, None)
        elif spec.startswith(("models:/", "runs:/")):
            from infra.zoo import model_signature
            from registry.tracking import load_translator_uri

            translator, _ = load_translator_uri(spec, model_signature(source), model_signature(target))
            conditions[spec] = translated(src, tgt, translator)
        else:
            conditions[Path(spec).name or spec] = translated(src, tgt, load_for_pair(spec, source, target))
    if len(conditions) == 2:
        raise ConfigError(
            f"no translator to evaluate: {fit_dir} holds no closed_form/ or distilled/ artifact. Run "
            f"`kvlingo fit {source.name} {target.name}` first, or pass --translator PATH|URI|identity"
        )
    return conditions


# -- prompts ---------------------------------------------------------------------------------------------------
def chat_prompt(tokenizer, user_text: str, answer_prefix: str = "") -> torch.Tensor:
    """[n] token ids of a one-turn chat (template when the tokenizer has one) ending where the answer starts."""
    from infra.samples import has_chat_template

    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True)
    else:
        text = f"User: {user_text}\nAssistant:"
    text = text + (answer_prefix if not answer_prefix or text.endswith((" ", "\n")) else " " + answer_prefix)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def messages_prompt(tokenizer, messages: list[dict]) -> torch.Tensor:
    from infra.samples import flatten_conversation, has_chat_template

    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = flatten_conversation(messages) + "\nAssistant:"
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<end_of_turn>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


def _generate(condition, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    from evals.conditions import greedy_generate

    out = greedy_generate(condition, ids, max_new_tokens, frozenset(_stop_ids(tokenizer)))
    return tokenizer.decode(out, skip_special_tokens=True)


# -- benchmarks: each returns {benchmark: {condition: {item id: score}}} -----------------------------------------
ItemScores = dict[str, float]


def bench_val_kl(config, conditions, source, target) -> dict[str, dict[str, ItemScores]]:
    """Per-sample mean KL(target native ‖ condition) over held-out continuations (lower is better)."""
    from infra.conversations import load_conversations
    from infra.samples import build_samples
    from translators.continuation import kl_per_position, teacher_logits

    # Held-out conversations (a seed far from training's); more are drawn than needed because short ones give
    # no plain-text window for models without a chat template.
    corpus = load_conversations("embedded", limit=4 * config.limit, seed=10_000 + config.seed)
    samples = build_samples(corpus, target.tokenizer, seed=config.seed, max_prefix_tokens=512, max_continuation_tokens=48,
                            prefix_tokens=32, continuation_tokens=8)[: config.limit]
    scores: dict[str, ItemScores] = {name: {} for name in conditions}
    with torch.no_grad():
        for i, s in enumerate(samples):
            teacher = teacher_logits(target.model, s.prefix_ids, s.continuation_ids)
            for name, condition in conditions.items():
                if name == "target_native":
                    scores[name][str(i)] = 0.0
                    continue
                student = _condition_logits(condition, s.prefix_ids, s.continuation_ids)
                scores[name][str(i)] = kl_per_position(teacher, student).mean().item()
    return {"val_kl": scores}


def _condition_logits(condition, prefix, continuation) -> torch.Tensor:
    from evals.conditions import continuation_logits

    return continuation_logits(condition, prefix, continuation)


def bench_recall(config, conditions, source, target) -> dict[str, dict[str, ItemScores]]:
    """Held-out synthetic recall/QA items (facts, needles, grounded QA): gold answer in the first line."""
    from infra.synthetic_chat import recall_items

    items = recall_items(config.limit, seed=config.seed)
    scores: dict[str, ItemScores] = {name: {} for name in conditions}
    for i, item in enumerate(items):
        ids = messages_prompt(target.tokenizer, item.messages)
        gold = item.answer.strip().rstrip(".")
        for name, condition in conditions.items():
            text = _generate(condition, target.tokenizer, ids, config.max_new_tokens)
            scores[name][str(i)] = float(gold.lower() in text.strip().split("\n")[0].lower())
    return {"recall": scores}


def _ruler(config, conditions, target, haystack: str) -> dict[str, dict[str, ItemScores]]:
    from evals.ruler import build_ruler_items, score_ruler

    essay = Path(config.data_dir) / NEEDS_DATA["ruler_essay"] if haystack == "essay" else None
    items = build_ruler_items(target.tokenizer, config.ruler_lengths, config.limit, haystack=haystack, essay_path=essay, seed=config.seed)
    out: dict[str, dict[str, ItemScores]] = {}
    for i, item in enumerate(items):
        ids = chat_prompt(target.tokenizer, item.prompt(), item.answer_prefix)
        bucket = out.setdefault(f"ruler_{haystack}_{item.length}", {n: {} for n in conditions})
        for name, condition in conditions.items():
            bucket[name][str(i)] = score_ruler(_generate(condition, target.tokenizer, ids, 12), item)
    return out


def bench_ruler_noise(config, conditions, source, target):
    return _ruler(config, conditions, target, "noise")


def bench_ruler_essay(config, conditions, source, target):
    return _ruler(config, conditions, target, "essay")


def bench_lm_eval(names: list[str], config, conditions, target) -> dict[str, dict[str, ItemScores]]:
    """Local MMLU-Pro / ARC-Challenge / GSM8K through the lm-eval adapter, per item (keyed by lm-eval's doc id),
    for every condition. An item whose metric a condition did not produce is absent from that condition."""
    from evals.lm_eval_adapter import KvlingoLM
    from evals.lm_eval_tasks import materialise_tasks, run_lm_eval

    tasks_dir = Path(tempfile.mkdtemp(prefix="kvlingo-lm-eval-"))
    task_names = [LM_EVAL_TASKS[n] for n in names]
    materialise_tasks(Path(config.data_dir), tasks_dir, limit=config.limit, tasks=task_names)
    out: dict[str, dict[str, ItemScores]] = {n: {} for n in names}
    max_len = target.layout.max_positions
    for cname, condition in conditions.items():
        lm = KvlingoLM(condition, target.tokenizer, max_gen_toks=min(64, max_len // 4), show_progress=False)
        results = run_lm_eval(lm, task_names, include_path=tasks_dir, limit=config.limit, per_item=True,
                              gen_kwargs={"max_gen_toks": min(64, max_len // 4)} if "gsm8k" in names else None)
        for name, task in zip(names, task_names):
            out[name][cname] = lm_eval_item_scores(results[task]["items"], LM_EVAL_METRICS[name], LM_EVAL_FILTERS[name])
    return out


def lm_eval_item_scores(items: list[dict[str, Any]], metric: str, filter_name: str) -> ItemScores:
    """doc id -> `metric` of run_lm_eval's per-item records under one filter; records without the metric are
    left out (the condition did not score that item).

    Raises:
        ConfigError: a doc id appears twice under the filter.
    """
    scores: ItemScores = {}
    for item in items:
        if item.get("filter") != filter_name or item.get(metric) is None:
            continue
        doc_id = str(item["doc_id"])
        if doc_id in scores:
            raise ConfigError(f"lm-eval logged doc {doc_id} twice under filter {filter_name!r}: cannot pair it by id")
        scores[doc_id] = float(item[metric])
    return scores


def bench_xquad(config, conditions, source, target) -> dict[str, dict[str, ItemScores]]:
    """CoQA-style grounded multi-turn QA from XQuAD paragraphs, single switch per turn: token F1."""
    from evals.qa import chat_messages, load_xquad, score_turn

    conversations = load_xquad(Path(config.data_dir) / NEEDS_DATA["xquad_multiturn"], limit=config.limit, max_turns=3)
    scores: dict[str, ItemScores] = {name: {} for name in conditions}
    for conv in conversations:
        golds = [turn.golds[0] for turn in conv.turns]
        for t, turn in enumerate(conv.turns):
            ids = messages_prompt(target.tokenizer, chat_messages(conv, golds[:t]))
            if ids.numel() > target.layout.max_positions - config.max_new_tokens:
                continue
            for name, condition in conditions.items():
                prediction = _generate(condition, target.tokenizer, ids, config.max_new_tokens)
                scores[name][f"{conv.id}/{t}"] = score_turn(prediction, turn)["f1"]
    return {"xquad_multiturn_f1": scores}


def bench_judge(config, conditions, source, target) -> dict[str, dict[str, Any]]:
    """MT-Bench single-answer grading (1–10) of each condition's answer to the first turn, keyed by question id;
    a question whose verdict did not parse is absent from that condition (and counted in "_extra")."""
    from evals.judge import (
        LocalHFJudge,
        OpenAICompatibleJudge,
        judge_answers,
        load_judge_templates,
        load_mt_bench_questions,
        mt_bench_items,
    )

    data = Path(config.data_dir) / "mt_bench"
    templates = load_judge_templates(data / "judge_prompts.jsonl")
    questions = load_mt_bench_questions(data / "question.jsonl", data / "reference_answer" / "gpt-4.jsonl", limit=config.limit)
    if config.judge_url:
        judge = OpenAICompatibleJudge(config.judge_url, config.judge_model)
    else:
        from infra.zoo import load_model

        judged = load_model(config.judge_model)
        judge = LocalHFJudge(judged.model, judged.tokenizer, max_new_tokens=64)
    out, extra = {}, {}
    for name, condition in conditions.items():
        answers = {q.question_id: _generate(condition, target.tokenizer, chat_prompt(target.tokenizer, q.turns[0]),
                                            config.max_new_tokens * 4) for q in questions}
        result = judge_answers(judge, mt_bench_items(questions, answers), templates)
        out[name] = result.scores()
        extra[name] = {"n_unparseable": result.n_unparseable}
    return {"mt_bench_judge": out, "_extra": extra}


BENCH_FUNCTIONS: dict[str, Callable] = {
    "val_kl": bench_val_kl,
    "recall": bench_recall,
    "ruler_noise": bench_ruler_noise,
    "ruler_essay": bench_ruler_essay,
    "xquad_multiturn": bench_xquad,
    "mt_bench_judge": bench_judge,
}


def rows_for(benchmark: str, per_condition: dict[str, ItemScores], extra: dict | None = None) -> list[dict[str, Any]]:
    """Tidy rows; translated conditions get the paired CI of (condition − target_native) over the item ids both
    scored, aligned by id (when at least two are shared)."""
    from evals.metrics import score_row

    rows = []
    native = per_condition.get("target_native")
    for name, items in per_condition.items():
        if len(items) == 0:
            continue
        paired = native is not None and name not in ("target_native", "source_native") and len(native.keys() & items.keys()) >= 2
        row = score_row(benchmark, name, items, native=native if paired else None).to_dict()
        if extra and name in extra:
            row["extra"] = {**row.get("extra", {}), **extra[name]}
        rows.append(row)
    return rows


def run_eval(config: EvalConfig, *, on_benchmark: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score every selected benchmark under every condition. A judge that cannot be reached is reported as an
    error row; the other benchmarks' results are kept."""
    from evals.judge import JudgeUnavailableError
    from infra.pairs import check_same_tokenizer
    from infra.zoo import load_model

    preflight(config)
    source, target = load_model(config.source), load_model(config.target)
    check_same_tokenizer(source, target)
    conditions = build_conditions(config, source, target)
    selected = config.selected()
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    lm_eval_names = [n for n in selected if n in LM_EVAL_TASKS]
    for name in selected:
        if name in LM_EVAL_TASKS:
            continue
        if on_benchmark:
            on_benchmark(name)
        try:
            result = BENCH_FUNCTIONS[name](config, conditions, source, target)
        except JudgeUnavailableError as err:
            errors.append({"benchmark": name, "error": str(err)})
            continue
        extra = result.pop("_extra", None)
        for bench, per_condition in result.items():
            rows += rows_for(bench, per_condition, extra)
    if lm_eval_names:
        if on_benchmark:
            on_benchmark("lm-eval: " + ", ".join(lm_eval_names))
        for bench, per_condition in bench_lm_eval(lm_eval_names, config, conditions, target).items():
            rows += rows_for(bench, per_condition)
    return {"source": source.name, "target": target.name, "conditions": list(conditions), "rows": rows, "errors": errors}
