"""LLM-as-a-judge, MT-Bench single-answer grading on a 1–10 scale (Zheng et al., 2023; KV-Lingo App. D).

Templates come from MT-Bench's judge_prompts.jsonl (FastChat llm_judge): "single-v1" for open questions and
"single-math-v1" when the item carries a reference answer. The judge decodes greedily; the answer it sees has
any reasoning trace removed. A verdict without a readable "[[rating]]" in 1–10 is counted as unparseable and
reported, never dropped silently nor read as a low score.

Judges: OpenAICompatibleJudge (any /chat/completions server: vLLM, llama.cpp server, SGLang, OpenAI) and
LocalHFJudge (a transformers model in-process).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from evals.errors import require_file
from evals.metrics import mean_se
from translators.errors import ConfigError, PrefixTooLongError

MT_BENCH_HELP = ("MT-Bench files (question.jsonl, judge_prompts.jsonl, reference_answer/gpt-4.jsonl) are in "
                 "lm-sys/FastChat under fastchat/llm_judge/data/mt_bench/ and data/; pass their paths.")
GENERAL_TEMPLATE = "single-v1"
REFERENCE_TEMPLATE = "single-math-v1"
# FastChat's llm_judge grades these categories against a reference answer (its NEED_REF_CATS).
REFERENCE_CATEGORIES = ("math", "reasoning", "coding")
RATING_RANGE = (1.0, 10.0)

_RATING = re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]")
_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


class JudgeUnavailableError(ConfigError):
    """The judge endpoint could not be reached or did not answer like a chat-completions server."""


# ---------------------------------------------------------------------------------------------------------------
# Templates, questions, items
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeTemplate:
    """One judge prompt of judge_prompts.jsonl; prompt_template has {question}, {answer} (and {ref_answer_1})."""

    name: str
    type: str
    system_prompt: str
    prompt_template: str
    output_format: str


@dataclass(frozen=True)
class JudgeItem:
    """A question, the answer to grade, and an optional reference answer (selects the reference template)."""

    question: str
    answer: str
    reference: str | None = None
    id: str = ""


@dataclass(frozen=True)
class MTBenchQuestion:
    """One MT-Bench question: turns (usually two) and reference answers per turn for reference categories."""

    question_id: int
    category: str
    turns: tuple[str, ...]
    reference: tuple[str, ...] | None = None


def _read_jsonl(path: str | Path, what: str) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (blank lines skipped).

    Raises:
        DataNotFoundError: the file is missing.
        ConfigError: a line is not a JSON object.
    """
    path = require_file(path, what, MT_BENCH_HELP)
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{lineno} is not valid JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{lineno} is not a JSON object")
        records.append(record)
    return records


def load_judge_templates(path: str | Path) -> dict[str, JudgeTemplate]:
    """Judge templates by name from a judge_prompts.jsonl. Checks the two single-answer templates are there.

    Raises:
        DataNotFoundError: the file is missing.
        ConfigError: a record lacks a field, or "single-v1"/"single-math-v1" is absent.
    """
    templates = {}
    for record in _read_jsonl(path, "MT-Bench judge prompts"):
        try:
            templates[record["name"]] = JudgeTemplate(record["name"], record["type"], record["system_prompt"],
                                                      record["prompt_template"], record["output_format"])
        except KeyError as exc:
            raise ConfigError(f"{path}: judge template {record.get('name')!r} lacks field {exc}") from exc
    missing = [n for n in (GENERAL_TEMPLATE, REFERENCE_TEMPLATE) if n not in templates]
    if missing:
        raise ConfigError(f"{path} lacks judge templates {missing} (has {sorted(templates)}). {MT_BENCH_HELP}")
    return templates


def load_mt_bench_questions(
    path: str | Path,
    reference_path: str | Path | None = None,
    limit: int | None = None,
) -> list[MTBenchQuestion]:
    """MT-Bench questions from question.jsonl.

    Reference answers are attached for the reference categories (math, reasoning, coding) only, as FastChat
    does: from reference_path (reference_answer/gpt-4.jsonl, choices[0].turns) when given, else from the
    question's own "reference" field.

    Raises:
        DataNotFoundError: a file is missing.
        ConfigError: malformed records, or limit < 1.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1 (or None for all), got {limit}")
    refs: dict[int, tuple[str, ...]] = {}
    if reference_path is not None:
        for r in _read_jsonl(reference_path, "MT-Bench reference answers"):
            try:
                refs[int(r["question_id"])] = tuple(r["choices"][0]["turns"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise ConfigError(f"{reference_path}: reference record lacks question_id or "
                                  f"choices[0].turns ({exc})") from exc
    questions = []
    for q in _read_jsonl(path, "MT-Bench questions")[:limit]:
        try:
            qid, category = int(q["question_id"]), q["category"]
            turns = tuple(q["turns"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: question record lacks question_id/category/turns ({exc})") from exc
        reference = refs.get(qid) if reference_path is not None else q.get("reference")
        keep = category in REFERENCE_CATEGORIES and reference
        questions.append(MTBenchQuestion(qid, category, turns, tuple(reference) if keep else None))
    return questions


def mt_bench_items(questions: Sequence[MTBenchQuestion], answers: Mapping[int, str]) -> list[JudgeItem]:
    """First-turn judge items for the questions that have an answer (answers keyed by question_id)."""
    return [JudgeItem(q.turns[0], answers[q.question_id], q.reference[0] if q.reference else None,
                      str(q.question_id)) for q in questions if q.question_id in answers]


def strip_reasoning(text: str) -> str:
    """Remove <think>…</think> blocks (an unclosed one runs to the end) and surrounding whitespace."""
    return _THINK_BLOCK.sub("", text).strip()


def render_judge_prompt(item: JudgeItem, templates: Mapping[str, JudgeTemplate]) -> tuple[str, str]:
    """(system prompt, user prompt) for one item: the reference template when item.reference is set.

    Raises:
        ConfigError: the needed template is missing from `templates`.
    """
    name = REFERENCE_TEMPLATE if item.reference is not None else GENERAL_TEMPLATE
    if name not in templates:
        raise ConfigError(f"judge template {name!r} not loaded (have {sorted(templates)}). {MT_BENCH_HELP}")
    template = templates[name]
    fields = {"question": item.question, "answer": strip_reasoning(item.answer)}
    if item.reference is not None:
        fields["ref_answer_1"] = item.reference
    return template.system_prompt, template.prompt_template.format(**fields)


def parse_rating(text: str) -> float | None:
    """The judge's rating: the last "[[x]]" (x an integer or decimal) outside any reasoning block, if in 1–10.

    The last one is taken because judges sometimes quote the format example ("Rating: [[5]]") before the
    verdict. Anything else (no brackets, "[[rating]]", out-of-range numbers such as a year) is None.
    """
    matches = _RATING.findall(strip_reasoning(text))
    if not matches:
        return None
    value = float(matches[-1])
    return value if RATING_RANGE[0] <= value <= RATING_RANGE[1] else None


# ---------------------------------------------------------------------------------------------------------------
# Judges
# ---------------------------------------------------------------------------------------------------------------


class Judge(Protocol):
    """Anything that returns the judge's reply text for a (system, user) prompt, decoding greedily."""

    def complete(self, system: str, user: str) -> str: ...


class OpenAICompatibleJudge:
    """A judge behind an OpenAI-compatible chat-completions endpoint ({base_url}/chat/completions).

    base_url: e.g. "http://127.0.0.1:8000/v1"; model: the served model name; api_key: sent as a bearer token
    when given; timeout: seconds per request; max_tokens: the judge's generation budget; retries: extra
    connection attempts (httpx transport retries; connection failures only).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 max_tokens: int = 1024, retries: int = 1) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"judge base_url must start with http:// or https://, got {base_url!r}")
        if timeout <= 0 or max_tokens < 1 or retries < 0:
            raise ConfigError(f"judge needs timeout > 0, max_tokens >= 1, retries >= 0; got {timeout}, "
                              f"{max_tokens}, {retries}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Creating the client opens no connection; the first request does.
        self._client = httpx.Client(timeout=timeout, headers=headers,
                                    transport=httpx.HTTPTransport(retries=retries))

    def complete(self, system: str, user: str) -> str:
        """The judge's reply to one prompt (temperature 0).

        Raises:
            JudgeUnavailableError: connection failure, timeout, HTTP error status, or a body that is not a
                chat completion; the message names the URL and the underlying error.
        """
        body = {"model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        try:
            response = self._client.post(self.url, json=body)
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise JudgeUnavailableError(f"judge endpoint {self.url} answered HTTP {exc.response.status_code}: "
                                        f"{exc.response.text[:300]}") from exc
        except httpx.HTTPError as exc:
            raise JudgeUnavailableError(f"judge endpoint {self.url} unreachable ({type(exc).__name__}: {exc}); "
                                        "start the judge server or fix --judge-url") from exc
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeUnavailableError(f"judge endpoint {self.url} did not return a chat completion "
                                        f"({type(exc).__name__}: {exc}): {response.text[:300]}") from exc
        return content or ""  # a null content (e.g. refusal) is an unparseable verdict, not an error

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAICompatibleJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalHFJudge:
    """A transformers causal LM as judge, greedy decoding, the tokenizer's chat template when it has one."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 512) -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens

    def _input_ids(self, system: str, user: str) -> Any:
        """Prompt token ids [1, n]: a system and a user turn rendered by `infra.chat` (the chat template when the
        tokenizer has one, else plain "Role: content" lines), ending where the judge's answer starts."""
        from infra.chat import chat_ids

        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return chat_ids(self.tokenizer, messages, generation_prompt=True).view(1, -1)

    def complete(self, system: str, user: str) -> str:
        """The model's greedy reply (new tokens only, special tokens removed).

        Raises:
            PrefixTooLongError: prompt plus max_new_tokens exceed the model's maximum positions.
        """
        import torch  # local: only this judge needs torch

        ids = self._input_ids(system, user).to(self.model.device)  # [1, n]
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + self.max_new_tokens > limit:
            raise PrefixTooLongError(f"judge prompt ({ids.shape[1]} tokens) + max_new_tokens "
                                     f"({self.max_new_tokens}) exceed the judge model's {limit} positions")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.max_new_tokens, pad_token_id=pad)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class JudgeResult:
    """Ratings per item id (None = unparseable verdict), the raw verdicts per item id, and mean ± se over the
    parsed ratings.

    mean and se are None when no verdict parsed; n is the number of parsed ratings.
    """

    ratings: dict[str, float | None]
    verdicts: dict[str, str]
    n_unparseable: int
    mean: float | None
    se: float | None
    n: int

    def scores(self) -> dict[str, float]:
        """The parsed ratings, item id -> rating (the condition's per-item scores for evals.metrics.score_row)."""
        return {item_id: r for item_id, r in self.ratings.items() if r is not None}


def judge_answers(judge: Judge, items: Sequence[JudgeItem],
                  templates: Mapping[str, JudgeTemplate]) -> JudgeResult:
    """Grade each item once with the judge and summarise, keyed by item id.

    Raises:
        ConfigError: no items, two items with the same id, or a needed template is missing.
        JudgeUnavailableError: (from an endpoint judge) the judge cannot be reached; no partial result.
    """
    if not items:
        raise ConfigError("no items to judge")
    _check_distinct_ids(items)
    prompts = [render_judge_prompt(item, templates) for item in items]  # all template problems before any call
    verdicts = {item.id: judge.complete(system, user) for item, (system, user) in zip(items, prompts)}
    ratings = {item_id: parse_rating(v) for item_id, v in verdicts.items()}
    parsed = [r for r in ratings.values() if r is not None]
    mean, se = mean_se(parsed) if parsed else (None, None)
    return JudgeResult(ratings, verdicts, len(ratings) - len(parsed), mean, se, len(parsed))


def _check_distinct_ids(items: Sequence[JudgeItem]) -> None:
    """Raises ConfigError naming ids shared by several items (ratings are keyed, and paired, by id)."""
    repeated = sorted(item_id for item_id, count in Counter(item.id for item in items).items() if count > 1)
    if repeated:
        raise ConfigError(f"judge items need distinct ids (conditions are paired by item id); repeated: {repeated}")
