"""What a benchmark is: a spec (name, suites, required files, metric, direction) and a per-item runner.

A runner is `run(context, condition, limit) -> {item id: score}`: it builds its items deterministically from
the context (so every condition scores the same items) and scores them under one `evals.conditions.Condition`.
An item a condition could not score is left out of that condition's mapping; rows pair conditions by id.

Item shards (evaluation on Ray, tasks/evaluate.py): a spec with `item_shards=True` has a runner that scores only
the items `context.owns(index, total)` gives its shard (`context.shard`, (index, count); (0, 1), every item, by
default). Shard k of n owns the k-th of n contiguous blocks of the runner's deterministic item list, so the
shards' mappings concatenated in shard order (`merge_shards`) are the one-process mapping: same ids, same scores,
same order (the bootstrap CIs read the items in that order).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from translators.errors import ConfigError, KvlingoError

SUITES = ("data_free", "quick", "full")
SUITE_HELP = {
    "data_free": "needs no files: runs on every pair out of the box (the default without --data-dir)",
    "quick": "the data-free suite plus RULER noise, switch quality and the local-file benchmarks (the default with "
             "--data-dir)",
    "full": "everything, including the RULER essay haystack and the MT-Bench judge",
}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class ItemScores(dict):
    """{item id: score} of one condition, optionally with `extra` details for that condition's row
    (e.g. how many judge verdicts did not parse)."""

    def __init__(self, scores: Mapping[str, float] | None = None, *, extra: Mapping[str, Any] | None = None):
        super().__init__(scores or {})
        self.extra: dict[str, Any] = dict(extra or {})


class BenchmarkUnavailableError(KvlingoError):
    """A benchmark cannot run right now for a reason outside the models (a judge endpoint is down): the
    evaluation reports it as an error entry and keeps the other benchmarks' results."""


@dataclass
class BenchContext:
    """Everything a runner may read besides the condition.

    source, target: the loaded pair (`infra.zoo` models: .name, .model, .tokenizer, .layout); None during
        preflight, when only settings are checked.
    data_dir: the folder holding the local benchmark files (`--data-dir`), or None.
    options: benchmark-specific settings by name (e.g. "ruler_lengths", "judge_url", "judge_model").
    memo: per-evaluation cache for work shared by conditions or benchmarks (items, teacher logits), see `cached`.
    shard: (index, count): the item shard a runner with `item_shards` scores (`owns`); (0, 1) is every item.
    """

    source: Any = None
    target: Any = None
    data_dir: Path | None = None
    seed: int = 0
    max_new_tokens: int = 24
    options: dict[str, Any] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict)
    shard: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        index, count = self.shard
        if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
            raise ConfigError(f"item shard {self.shard!r} must be (index, count) with 0 ≤ index < count")

    def for_shard(self, index: int, count: int) -> BenchContext:
        """This context scoring item shard `index` of `count` (sharing the memo: items, teacher logits)."""
        return replace(self, shard=(index, count))

    def owns(self, index: int, total: int) -> bool:
        """Whether this shard scores item `index` (0-based) of a runner's `total` items in their deterministic
        order: shard k of n owns indices [total·k // n, total·(k+1) // n), a contiguous block, so concatenating the
        shards' mappings in shard order restores the one-process order. Always True for the (0, 1) shard."""
        k, n = self.shard
        return total * k // n <= index < total * (k + 1) // n

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """build() once per key for the whole evaluation (every condition and benchmark shares it)."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def data_file(self, relative: str | tuple[str, ...]) -> Path:
        """The path of a required file under data_dir (the first existing alternative of a tuple).

        Raises:
            ConfigError: no data_dir (preflight normally catches this first).
        """
        if self.data_dir is None:
            raise ConfigError(f"{relative} is read from --data-dir, and none was given")
        alternatives = (relative,) if isinstance(relative, str) else relative
        found = [Path(self.data_dir) / a for a in alternatives if (Path(self.data_dir) / a).is_file()]
        return found[0] if found else Path(self.data_dir) / alternatives[0]


Runner = Callable[[BenchContext, Any, int], Mapping[str, float]]


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark, as preflight, evaluation, the fit flow and the README table read it.

    name: the `--benchmark` name and the row name (lowercase, digits, underscores).
    suites: which of SUITES run it.
    metric: what a score is, in words (with its unit).
    higher_is_better: the direction of `metric`.
    run: the per-item runner `run(context, condition, limit) -> {item id: score}`.
    required_files: paths under --data-dir the benchmark reads; an entry that is a tuple accepts any one of
        its alternatives (the first is the one named in messages).
    description: one line for the README table and `--help`.
    check: optional `check(context) -> [problem, ...]` on the settings (no models loaded yet), for options the
        benchmark needs (a judge model, sensible lengths).
    row_groups: item ids are "<group>/<id>" and rows are reported per group as "<name>_<group>" (RULER reports
        one row per context length); ids are paired within a group.
    item_shards: the runner scores only the items `context.owns` assigns to `context.shard` (and reports no
        per-shard `extra`), so evaluation on Ray may split its items over workers; False: one unit scores all
        of a condition's items (runners that score their items jointly: lm-eval tasks, the MT-Bench judge).
    conversations: the runner reads its items as conversations through `_common.generate_messages` /
        `answer_logprob`, which also serve `evals.cross_conditions.CrossCondition`: the benchmark runs on pairs
        whose models tokenize differently. The others read token ids shared by both models.
    """

    name: str
    suites: tuple[str, ...]
    metric: str
    higher_is_better: bool
    run: Runner
    required_files: tuple[str | tuple[str, ...], ...] = ()
    description: str = ""
    check: Callable[[BenchContext], list[str]] | None = None
    row_groups: bool = False
    item_shards: bool = False
    conversations: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(f"name {self.name!r} must be lowercase letters, digits and underscores")
        if not self.suites or any(s not in SUITES for s in self.suites):
            problems.append(f"suites {self.suites!r} must be a non-empty subset of {SUITES}")
        if not callable(self.run):
            problems.append("run must be callable as run(context, condition, limit)")
        if not self.metric:
            problems.append("metric must say what a score is")
        if problems:
            raise ConfigError(f"benchmark spec {self.name!r}: " + "; ".join(problems))

    @property
    def needs_data(self) -> bool:
        return bool(self.required_files)

    def missing_files(self, data_dir: Path | None) -> list[Path]:
        """Required files not found under data_dir (each named by its first alternative); [] when all exist."""
        missing = []
        for entry in self.required_files:
            alternatives = (entry,) if isinstance(entry, str) else tuple(entry)
            if data_dir is None or not any((Path(data_dir) / a).is_file() for a in alternatives):
                missing.append(Path(data_dir or ".") / alternatives[0])
        return missing

    def files_text(self) -> str:
        """The required files in words ("a/b.json, c.jsonl (or c.jsonl.gz)"), "" when none."""
        parts = []
        for entry in self.required_files:
            alternatives = (entry,) if isinstance(entry, str) else tuple(entry)
            parts.append(alternatives[0] + (f" (or {', '.join(alternatives[1:])})" if len(alternatives) > 1 else ""))
        return ", ".join(parts)


def merge_shards(parts: Sequence[Mapping[str, float]]) -> ItemScores:
    """One condition's {item id: score} from its item shards' mappings, given in shard order (see
    `BenchContext.owns`): their concatenation, which is the one-process mapping in its order. The shards' `extra`
    entries are merged too (item-sharded runners report none).

    Raises:
        ConfigError: two shards scored one item differently (a runner whose items are not deterministic).
    """
    merged = ItemScores()
    for part in parts:
        for item, score in part.items():
            if item in merged and merged[item] != score:
                raise ConfigError(f"item {item!r} was scored {merged[item]} and {score} by two shards: a runner's "
                                  "items must be the same in every process")
            merged.setdefault(item, score)
        merged.extra.update(getattr(part, "extra", None) or {})
    return merged
