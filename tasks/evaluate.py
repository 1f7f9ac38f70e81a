"""The benchmark suite: the same items scored under every condition, so every delta is paired.

Benchmarks come from the registry in `evals/benchmarks/` (one module per benchmark: its spec and per-item
runner); adding a benchmark is adding a module there, and preflight, this loop, the fit flow and the README
table pick it up. Without `--data-dir` the default suite is `data_free` (works on every pair); with one it is
`quick` (the data-free benchmarks plus the local-file ones).

Conditions: `target_native`, `source_native`, `empty_prefix` (the floor: the target reads nothing of the
context but its last token), and one translated condition per translator: `closed_form` and `distilled` from
the pair's fit directory when present, plus any `--translator` (a path, a registry URI, or `identity` for a
model translated into itself). Translated and empty-prefix rows carry the paired bootstrap CI of
(condition − target_native) on the same items: every benchmark returns each condition's scores keyed by item
id, and the pairing keeps the ids both conditions scored (a condition may fail an item the other scored).

With `workers` > 1 or a Ray address the units (benchmark, condition, item shard) run on Ray actors
(`_score_on_ray`); item-sharded benchmarks (`BenchmarkSpec.item_shards`) split their items by index into
`workers` contiguous shards, and the merged shards give the one-process rows and CIs exactly.

Composition only: items, metrics and conditions live in evals/, the numerics in translators/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from translators.errors import ConfigError

# Conditions whose rows are not paired against target_native (a different model answers).
UNPAIRED = ("target_native", "source_native")


class EvalConfig(BaseModel):
    """`kvlingo eval`: which pair, which benchmarks, which translators, how many items."""

    model_config = ConfigDict(extra="forbid")

    source: str
    target: str
    suite: Literal["data_free", "quick", "full"] | None = Field(
        None, description="default: data_free without data_dir, quick with it")
    benchmarks: list[str] | None = Field(None, description="run only these benchmarks (any registered name)")
    translators: list[str] = Field(default_factory=list, description="paths, models:/ URIs, or 'identity'")
    fit_dir: Path | None = Field(None, description="where closed_form/ and distilled/ are; default the pair's latest fit")
    limit: int = Field(8, ge=1, description="items per benchmark (per length for RULER)")
    data_dir: Path | None = Field(None, description="local benchmark files (MMLU-Pro, ARC, GSM8K, XQuAD, RULER essays, MT-Bench)")
    ruler_lengths: list[int] = Field(default_factory=lambda: [256, 512])
    max_new_tokens: int = Field(24, ge=1)
    judge_url: str | None = Field(None, description="OpenAI-compatible endpoint for the MT-Bench judge")
    judge_model: str | None = Field(None, description="judge model name at the endpoint, or a zoo model for a local judge")
    seed: int = 0
    workers: int = Field(1, ge=1, description="1: one process; >1: Ray actors score (benchmark, condition, item "
                         "shard) units, each item-sharded benchmark split into `workers` shards")
    ray_address: str | None = Field(None, description="Ray cluster to join (default RAY_ADDRESS); with it the "
                                    "benchmarks run on the cluster even with workers=1")

    def suite_name(self) -> str:
        from evals.benchmarks import default_suite

        return self.suite or default_suite(self.data_dir)

    def selected(self) -> list[str]:
        """The benchmark names to run: --benchmark's, else the suite's (registry order)."""
        from evals.benchmarks import suite

        return list(self.benchmarks) if self.benchmarks else suite(self.suite_name())

    def context(self, source=None, target=None):
        """The runners' view of this config (models None during preflight)."""
        from evals.benchmarks import BenchContext

        return BenchContext(source=source, target=target, data_dir=Path(self.data_dir) if self.data_dir else None,
                            seed=self.seed, max_new_tokens=self.max_new_tokens,
                            options={"ruler_lengths": list(self.ruler_lengths), "judge_url": self.judge_url,
                                     "judge_model": self.judge_model})


def preflight(config: EvalConfig) -> list:
    """Names, data files and benchmark settings, all checked before any model loads. Returns the specs to run.

    Raises:
        ConfigError: every problem at once (unknown benchmark with suggestions; a missing data file with where it
        looked and how to get it; settings a benchmark needs).
    """
    from evals.benchmarks import all_specs, unknown_benchmark_message
    from infra.zoo import pair_problems

    problems = pair_problems(config.source, config.target)
    specs = all_specs()
    context = config.context()
    chosen = []
    for name in dict.fromkeys(config.selected()):
        if name not in specs:
            problems.append(unknown_benchmark_message(name, list(specs)))
            continue
        spec = specs[name]
        chosen.append(spec)
        if spec.required_files and config.data_dir is None:
            problems.append(f"{name} reads local files: pass --data-dir (a folder holding {spec.files_text()}), or "
                            f"leave {name} out (the data_free suite needs no files)")
        else:
            for path in spec.missing_files(config.data_dir):
                problems.append(f"{name}: missing {path}; put the benchmark's public file there (see the README "
                                f"section on offline data) or leave {name} out (--benchmark NAME picks benchmarks)")
        if spec.check is not None:
            problems += [p for p in spec.check(context) if p not in problems]
    if problems:
        raise ConfigError("cannot start the evaluation:\n  " + "\n  ".join(problems))
    return chosen


# -- conditions ------------------------------------------------------------------------------------------------
def _latest_fit_or_pair_dir(source: str, target: str) -> Path:
    """The newest finished fit of the pair, else the pair's runs folder (which then holds no artifact)."""
    from infra.rundirs import latest_fit_dir, pair_runs_dir

    try:
        return latest_fit_dir(source, target)
    except ConfigError:
        return pair_runs_dir(source, target)


def build_conditions(config: EvalConfig, source, target) -> dict[str, Any]:
    """Condition name → evals.conditions.Condition (translators verified against the loaded pair); for a pair whose
    models tokenize differently, evals.cross_conditions.CrossCondition (each model renders items itself)."""
    from evals.conditions import empty_prefix, source_native, target_native, translated
    from evals.cross_conditions import cross_conditions
    from infra.pairs import load_for_pair, load_hybrid_for_pair, same_tokenizer
    from registry.translator_ref import load_translator_ref, parse_translator_ref
    from translators.layout import is_hybrid
    from translators.stage1 import Side

    fit_dir = Path(config.fit_dir) if config.fit_dir else _latest_fit_or_pair_dir(source.name, target.name)
    # A pair with a hybrid side has hybrid artifacts (recurrent-state strategies beside the per-token maps).
    load = load_hybrid_for_pair if is_hybrid(source.layout) or is_hybrid(target.layout) else load_for_pair
    translators = {stage: load(fit_dir / stage, source, target) for stage in ("closed_form", "distilled")
                   if (fit_dir / stage / "manifest.json").is_file()}
    for ref in map(parse_translator_ref, config.translators):  # PATH | models:/NAME@ALIAS | identity
        translators[ref.label] = load_translator_ref(ref, source, target)
    if not translators:
        raise ConfigError(
            f"no translator to evaluate: {fit_dir} holds no closed_form/ or distilled/ artifact. Run "
            f"`kvlingo fit {source.name} {target.name}` first, or pass --translator PATH|URI|identity"
        )
    if not same_tokenizer(source, target):
        return cross_conditions(source, target, translators)
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    conditions = {"target_native": target_native(tgt), "source_native": source_native(src),
                  "empty_prefix": empty_prefix(tgt)}
    for label, translator in translators.items():
        conditions[label] = translated(src, tgt, translator)
    return conditions


def cross_tokenizer_specs(specs: list) -> tuple[list, list[dict[str, str]]]:
    """The benchmarks that run on a cross-tokenizer pair (spec `conversations`) and an error entry for each other."""
    from evals.benchmarks import all_specs

    runnable = [spec for spec in specs if spec.conversations]
    capable = ", ".join(name for name, spec in all_specs().items() if spec.conversations)
    errors = [{"benchmark": spec.name, "error": "reads token ids shared by both models, and this pair's models "
               f"tokenize differently; the benchmarks that run across tokenizers are {capable} (--benchmark NAME)"}
              for spec in specs if not spec.conversations]
    return runnable, errors


# -- rows ------------------------------------------------------------------------------------------------------
ItemScores = dict[str, float]


def rows_for(benchmark: str, per_condition: Mapping[str, ItemScores], extra: Mapping[str, dict] | None = None,
             *, spec=None) -> list[dict[str, Any]]:
    """Tidy rows; translated (and empty-prefix) conditions get the paired CI of (condition − target_native) over
    the item ids both scored, aligned by id (when at least two are shared). With a spec, rows also say the metric
    and its direction, and a spec with row_groups gives one row per group ("<benchmark>_<group>")."""
    from evals.metrics import score_row

    if spec is not None and spec.row_groups:
        groups: dict[str, dict[str, ItemScores]] = {}
        for name, items in per_condition.items():
            for item, score in items.items():
                group, sep, rest = str(item).partition("/")
                group, rest = (group, rest) if sep else ("all", group)
                groups.setdefault(group, {n: {} for n in per_condition})[name][rest] = score
        order = sorted(groups, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
        return [_tag(row, spec) for g in order for row in rows_for(f"{benchmark}_{g}", groups[g], extra)]
    rows = []
    native = per_condition.get("target_native")
    for name, items in per_condition.items():
        if len(items) == 0:
            continue
        paired = native is not None and name not in UNPAIRED and len(native.keys() & items.keys()) >= 2
        row = score_row(benchmark, name, dict(items), native=dict(native) if paired else None).to_dict()
        if extra and name in extra:
            row["extra"] = {**row.get("extra", {}), **extra[name]}
        rows.append(_tag(row, spec) if spec is not None else row)
    return rows


def _tag(row: dict[str, Any], spec) -> dict[str, Any]:
    row["extra"] = {**row.get("extra", {}), "metric": spec.metric, "higher_is_better": spec.higher_is_better}
    return row


def score_benchmark(spec, context, conditions: Mapping[str, Any], limit: int) -> list[dict[str, Any]]:
    """Run one benchmark under every condition and return its rows."""
    per_condition: dict[str, ItemScores] = {}
    extra: dict[str, dict] = {}
    for name, condition in conditions.items():
        scores = spec.run(context, condition, limit)
        per_condition[name] = dict(scores)
        if getattr(scores, "extra", None):
            extra[name] = dict(scores.extra)
    return rows_for(spec.name, per_condition, extra, spec=spec)


def run_eval(config: EvalConfig, *, on_benchmark: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score every selected benchmark under every condition. A benchmark that cannot run for an outside reason
    (a judge endpoint that cannot be reached) is reported as an error entry; the others' results are kept."""
    from evals.benchmarks import BenchmarkUnavailableError
    from infra.pairs import same_tokenizer
    from infra.zoo import load_model

    from tasks.cluster import use_ray

    specs = preflight(config)
    source, target = load_model(config.source), load_model(config.target)
    conditions = build_conditions(config, source, target)
    context = config.context(source, target)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    if not same_tokenizer(source, target):
        specs, errors = cross_tokenizer_specs(specs)
    if use_ray(config.workers, config.ray_address):
        rows, ray_errors = _score_on_ray(config, specs, list(conditions), source, target, on_benchmark)
        errors += ray_errors
    else:
        for spec in specs:
            if on_benchmark:
                on_benchmark(spec.name)
            try:
                rows += score_benchmark(spec, context, conditions, config.limit)
            except BenchmarkUnavailableError as err:
                errors.append({"benchmark": spec.name, "error": str(err)})
    return {
        "source": source.name, "target": target.name,
        "suite": None if config.benchmarks else config.suite_name(),
        "conditions": list(conditions),
        "benchmarks": [{"name": s.name, "metric": s.metric, "higher_is_better": s.higher_is_better} for s in specs],
        "rows": rows, "errors": errors,
    }


# -- on Ray ----------------------------------------------------------------------------------------------------
_ACTOR_CONDITIONS: dict[str, Any] = {}  # in a Ray actor: the conditions of one eval config, built once


def _eval_unit(source, target, config_json: str, unit: tuple[str, str, tuple[int, int]]) -> dict[str, Any]:
    """Runs in a Ray actor holding the pair: one item shard (index, count) of one benchmark under one condition.
    Returns {"scores", "extra"} or {"error"} for a benchmark that cannot run for an outside reason."""
    from evals.benchmarks import BenchmarkUnavailableError, all_specs

    config = EvalConfig.model_validate_json(config_json)
    if config_json not in _ACTOR_CONDITIONS:
        _ACTOR_CONDITIONS.clear()
        _ACTOR_CONDITIONS[config_json] = (build_conditions(config, source, target), config.context(source, target))
    conditions, context = _ACTOR_CONDITIONS[config_json]
    spec_name, condition, (index, count) = unit
    try:  # the shard's context shares the actor's memo (items, teacher logits) with the other units
        scores = all_specs()[spec_name].run(context.for_shard(index, count), conditions[condition], config.limit)
    except BenchmarkUnavailableError as err:
        return {"error": str(err)}
    return {"scores": dict(scores), "extra": dict(getattr(scores, "extra", None) or {})}


def eval_units(specs: list, conditions: list[str], shards: int) -> list[tuple[str, str, tuple[int, int]]]:
    """The Ray work units (benchmark, condition, (shard index, shard count)): `shards` item shards of each
    benchmark whose spec has `item_shards`, one (0, 1) unit of the others (lm-eval tasks, the MT-Bench judge)."""
    units = []
    for spec in specs:
        count = max(1, shards) if spec.item_shards else 1
        units += [(spec.name, name, (k, count)) for name in conditions for k in range(count)]
    return units


def rows_from_units(specs: list, conditions: list[str], results: Mapping[tuple, Mapping[str, Any]]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows and error entries from every unit's result ({"scores", "extra"} or {"error"}, keyed by `eval_units`'
    units), in the one-process order: each condition's shards merged in shard order (`merge_shards`: the
    one-process {item id: score} in its order), then `rows_for` as in `score_benchmark`. A benchmark any of whose
    units is unavailable becomes one error entry."""
    from evals.benchmarks import ItemScores, merge_shards

    by_benchmark: dict[str, dict[str, list[tuple[int, Mapping[str, Any]]]]] = {}
    for (spec_name, name, (index, _count)), result in results.items():
        by_benchmark.setdefault(spec_name, {}).setdefault(name, []).append((index, result))
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    for spec in specs:
        mine = {name: [r for _, r in sorted(by_benchmark[spec.name][name], key=lambda x: x[0])] for name in conditions}
        failed = next((r["error"] for name in conditions for r in mine[name] if "error" in r), None)
        if failed is not None:
            errors.append({"benchmark": spec.name, "error": failed})
            continue
        per_condition: dict[str, ItemScores] = {}
        extra: dict[str, dict] = {}
        for name in conditions:
            merged = merge_shards([ItemScores(r["scores"], extra=r["extra"]) for r in mine[name]])
            per_condition[name] = dict(merged)
            if merged.extra:
                extra[name] = dict(merged.extra)
        rows += rows_for(spec.name, per_condition, extra, spec=spec)
    return rows, errors


def _score_on_ray(config: EvalConfig, specs: list, conditions: list[str], source, target,
                  on_benchmark: Callable[[str], None] | None) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every (benchmark, condition, item shard) unit (`eval_units`: item-sharded benchmarks split into
    `config.workers` shards) on `config.workers` Ray actors (tasks/cluster.py); rows assembled here in the
    one-process order (`rows_from_units`), so they equal `score_benchmark`'s (KL scores to fp32 rounding): items are keyed by id and assigned to
    shards by their index in the runner's deterministic item list, never by timing, and each unit runs its items
    with the same seed.

    Raises:
        ClusterError: the cluster cannot be reached or a worker failed.
    """
    from infra.zoo import model_signature
    from tasks.cluster import ordered_map, workers_for

    # The actors resolve nothing on their own: the fit directory and data folder travel as absolute paths.
    config = config.model_copy(update={
        "fit_dir": Path(config.fit_dir or _latest_fit_or_pair_dir(source.name, target.name)).resolve(),
        "data_dir": Path(config.data_dir).resolve() if config.data_dir else None})
    signatures = {"source": model_signature(source), "target": model_signature(target)}
    actors = workers_for(config.source, config.target, workers=config.workers, address=config.ray_address,
                         signatures=signatures)
    units = eval_units(specs, conditions, config.workers)
    if on_benchmark:
        for spec in specs:
            on_benchmark(spec.name)
    results = dict(zip(units, ordered_map(actors, "call", units, _eval_unit, config.model_dump_json())))
    return rows_from_units(specs, conditions, results)
