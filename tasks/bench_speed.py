"""`kvlingo bench speed`: the switch's time to first token against the target's re-prefill (paper §4.8,
App. Y), per prefix length, with peak memory, decoding speed after each path and the FLOP model.

Composition only: loading, prompts and the translator choice live here; the measurement is
`evals.speed.measure_speed`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.config import SpeedBenchConfig
from translators.errors import ConfigError, PrefixTooLongError
from translators.layout import is_hybrid

FIT_SAMPLES, FIT_WINDOW = 8, 128  # corpus windows for an on-the-fly closed form (speed does not need quality)
WARMUP_TOKENS = 32


def parse_lengths(text: str) -> list[int]:
    """'256,1024' → [256, 1024].

    Raises:
        ConfigError: an item that is not an integer, or an empty list.
    """
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    try:
        lengths = [int(item) for item in items]
    except ValueError:
        raise ConfigError(f"--lengths must be comma-separated integers like 256,1024,2048, got {text!r}") from None
    if not lengths:
        raise ConfigError("--lengths is empty: give at least one prefix length, e.g. --lengths 256,1024")
    return lengths


def preflight(config: SpeedBenchConfig) -> None:
    """Every check that needs no model, reported together.

    Raises:
        ConfigError: listing all problems.
    """
    from infra.zoo import pair_problems
    from registry.translator_ref import parse_translator_ref

    problems = pair_problems(config.source, config.target)
    if config.translator is not None:
        try:
            parse_translator_ref(config.translator)
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("cannot start the speed benchmark:\n  " + "\n  ".join(problems))


def check_lengths(lengths: list[int], max_positions: int, decode_tokens: int, model_name: str) -> None:
    """Raises PrefixTooLongError naming every length the model cannot read (prefix + decoded tokens)."""
    too_long = [n for n in lengths if n + decode_tokens > max_positions]
    if too_long:
        raise PrefixTooLongError(
            f"lengths {too_long} plus {decode_tokens} decoded tokens exceed the {max_positions} positions of "
            f"{model_name}; use lengths up to {max_positions - decode_tokens}"
        )


def run_speed(config: SpeedBenchConfig) -> dict[str, Any]:
    """Measure every length; returns the public JSON object {"rows": [...], ...metadata}."""
    from evals.memory import MEASURE
    from evals.speed import measure_speed, measure_speed_cross
    from infra.cross_samples import cross_prompt_of_length
    from infra.pairs import same_tokenizer
    from infra.prompts import prompt_of_length
    from translators.stage1 import Side

    preflight(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)  # both paths run in this process with the same threads
    started = time.perf_counter()
    source, target = _load_pair(config.source, config.target)
    if is_hybrid(source.layout) or is_hybrid(target.layout):
        return _run_hybrid(config, source, target, started)
    cross = not same_tokenizer(source, target)
    for loaded in (source, target):
        # A cross-tokenizer source renders the same text in its own tokens: leave it room for a longer rendering.
        slack = 2 if cross and loaded is source else 1
        check_lengths([n * slack for n in config.lengths], loaded.layout.max_positions, config.decode_tokens, loaded.name)
    translator, described = _translator(config, source, target)
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    point = translator.point if translator is not None else config.point
    if cross and translator is None:
        raise ConfigError(f"{source.name} and {target.name} tokenize differently: the identity cannot serve them; "
                          "pass a fitted translator (--translator PATH|models:/NAME@ALIAS) or none for a quick closed form")
    if cross:
        def prompt(n: int):
            return cross_prompt_of_length(source.tokenizer, target.tokenizer, n, seed=config.seed)

        def measure(prompt_, repeats: int, decode_tokens: int):
            return measure_speed_cross(src, tgt, translator, prompt_, repeats=repeats, decode_tokens=decode_tokens)
    else:
        def prompt(n: int):
            return prompt_of_length(target.tokenizer, n, seed=config.seed)

        def measure(prompt_, repeats: int, decode_tokens: int):
            return measure_speed(src, tgt, translator, prompt_, point=point, repeats=repeats, decode_tokens=decode_tokens)
    prompts = {n: prompt(n) for n in config.lengths}
    # Warm-up (discarded): first calls allocate workspaces and pick kernels.
    measure(prompt(max(WARMUP_TOKENS, min(config.lengths))), 1, 1)
    rows = []
    with _progress() as progress:
        task = progress.add_task("bench speed", total=len(config.lengths))
        for n in config.lengths:
            rows.append(measure(prompts[n], config.repeats, config.decode_tokens).as_dict())
            progress.advance(task)
    device = target.model.device
    return {
        "rows": rows,
        "source": source.name,
        "target": target.name,
        "translator": described,
        "point": point,
        "device": str(device),
        "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "memory": MEASURE,
        "wall_s": round(time.perf_counter() - started, 2),
    }


def hybrid_routes(config: SpeedBenchConfig, source, target) -> dict:
    """Quick closed forms of every state route the pair admits (`infra.hybrid_fit.fit_report`'s strategies but
    the corrected ones, which cost what copy costs plus two small matmuls per layer), fitted on FIT_SAMPLES
    corpus windows of FIT_WINDOW tokens, one window per capture: the right shapes and cost, rough quality.

    Returns:
        route → `translators.hybrid.HybridTranslator`: ``copy`` (same state geometry), ``replay`` (a hybrid
        target), ``zero`` (a hybrid target), ``translated`` (a target without linear layers).
    """
    from infra.prompts import prompt_of_length
    from translators.hybrid import fit_kv_maps, fit_replay_maps, make_translator, paired_captures, strategies_for
    from translators.states import COPY, REPLAY, ZERO, linear_layers, same_state_geometry

    # Another seed than the timed prompts (as `_quick_closed_form`).
    prompts = list(prompt_of_length(target.tokenizer, FIT_SAMPLES * FIT_WINDOW, seed=config.seed + 1)
                   .view(FIT_SAMPLES, FIT_WINDOW))
    src_caps, tgt_caps = paired_captures(source.model, source.layout, target.model, target.layout, prompts,
                                         config.point)
    if not linear_layers(target.layout):
        names = ["translated"]
    else:
        copies = same_state_geometry(source.layout, target.layout)
        names = ([COPY] if copies else []) + [REPLAY, ZERO]
    routes = {}
    for name in names:
        chosen = {} if name == "translated" else strategies_for(target.layout, name)
        translator = make_translator(source.layout, target.layout, target.model, chosen, config.point)
        fit_kv_maps(translator, src_caps, tgt_caps, ridge=1e-3)
        if name == REPLAY:
            fit_replay_maps(translator, target.model, src_caps, prompts, ridge=1e-3)
        routes[name] = translator
    return routes


def _run_hybrid(config: SpeedBenchConfig, source, target, started: float) -> dict[str, Any]:
    """`run_speed` for a pair with a hybrid side: per length, every route's switch stage by stage
    (`evals.hybrid_speed`) against the target's re-prefill.

    Raises:
        ConfigError: --translator given (hybrid translators have no artifact yet: the routes are fitted here), or
            the two models tokenize differently. PrefixTooLongError: a length beyond either model's positions.
    """
    from evals.hybrid_speed import measure_hybrid_speed
    from infra.pairs import same_tokenizer
    from infra.prompts import prompt_of_length
    from translators.stage1 import Side

    if config.translator is not None:
        raise ConfigError("--translator: translators for hybrid caches have no artifact yet; leave it out and "
                          "`bench speed` fits each state route's closed form on a few corpus windows")
    if not same_tokenizer(source, target):
        raise ConfigError(f"{source.name} and {target.name} tokenize differently: hybrid switches need one tokenizer")
    for loaded in (source, target):
        check_lengths(config.lengths, loaded.layout.max_positions, 1, loaded.name)
    routes = hybrid_routes(config, source, target)
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    prompts = {n: prompt_of_length(target.tokenizer, n, seed=config.seed) for n in config.lengths}
    # Warm-up (discarded): first calls allocate workspaces and pick kernels.
    measure_hybrid_speed(src, tgt, routes, prompt_of_length(target.tokenizer, WARMUP_TOKENS, seed=config.seed),
                         repeats=1)
    rows = []
    with _progress() as progress:
        task = progress.add_task("bench speed (hybrid)", total=len(config.lengths))
        for n in config.lengths:
            rows.extend(row.as_dict() for row in measure_hybrid_speed(src, tgt, routes, prompts[n],
                                                                      repeats=config.repeats))
            progress.advance(task)
    return {
        "hybrid": True,
        "rows": rows,
        "routes": list(routes),
        "source": source.name,
        "target": target.name,
        "translator": f"closed forms per state route fitted on {FIT_SAMPLES}×{FIT_WINDOW} corpus tokens",
        "point": config.point,
        "device": str(target.model.device),
        "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def _load_pair(source_name: str, target_name: str):
    """Load both models; one copy when source and target are the same name (a model switched into itself)."""
    from infra.zoo import load_model

    source = load_model(source_name)
    return source, (source if target_name == source_name else load_model(target_name))


def _translator(config: SpeedBenchConfig, source, target):
    """The translator to time and a description: a reference (`registry.translator_ref`; `identity` copies the
    source cache without maps), else the dense identity (same model) or a quick closed form.

    Raises:
        ConfigError: a malformed reference. PairMismatchError: a translator fitted for other models.
    """
    from registry.translator_ref import load_translator_ref, parse_translator_ref
    from infra.pairs import same_tokenizer
    from translators.switch import identity_translator

    if config.translator is not None:
        ref = parse_translator_ref(config.translator)
        translator = load_translator_ref(ref, source, target)
        described = "identity (source cache read as it is, no maps)" if translator is None else f"{ref.kind} {ref.text}"
        return translator, described
    if source.name == target.name:
        # Dense identity maps: exact, and they cost what a real ν=1 translator costs.
        return identity_translator(target.layout, config.point), "identity (dense ν=1 identity maps)"
    if not same_tokenizer(source, target):
        return (_quick_cross_closed_form(config, source, target),
                f"closed form fitted on {FIT_SAMPLES} aligned {FIT_WINDOW}-token prompts (depth, ν=1)")
    return _quick_closed_form(config, source, target), f"closed form fitted on {FIT_SAMPLES}×{FIT_WINDOW} corpus tokens (depth, ν=1)"


def _quick_cross_closed_form(config: SpeedBenchConfig, source, target):
    """`_quick_closed_form` for a cross-tokenizer pair: aligned one-message prompts instead of windows."""
    from infra.cross_samples import cross_prompt_of_length
    from translators.cross import accumulate_cross
    from translators.stage1 import Side, assign_layers, candidate_layers, empty_stats, solve_translator

    samples = [cross_prompt_of_length(source.tokenizer, target.tokenizer, FIT_WINDOW, seed=config.seed + 1 + k)
               for k in range(FIT_SAMPLES)]
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    candidates = candidate_layers(source.layout, target.layout, "depth", 1)
    stats = accumulate_cross(empty_stats(source.layout, target.layout, candidates), src, tgt, samples, config.point)
    assignment = assign_layers(stats, source.layout, target.layout, "depth", 1)
    return solve_translator(stats, assignment, source.layout, target.layout, config.point, ridge=1e-3)


def _quick_closed_form(config: SpeedBenchConfig, source, target):
    """A stage-1 translator from a few embedded-corpus windows: the right shapes and cost, rough quality."""
    from infra.prompts import prompt_of_length
    from translators.stage1 import Side, accumulate_pair, assign_layers, candidate_layers, empty_stats, solve_translator

    # Plain windows of the synthetic corpus work for every tokenizer (chat template or not); another seed than
    # the timed prompts.
    text_ids = prompt_of_length(target.tokenizer, FIT_SAMPLES * FIT_WINDOW, seed=config.seed + 1)
    windows = text_ids.view(FIT_SAMPLES, FIT_WINDOW)
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    candidates = candidate_layers(source.layout, target.layout, "depth", 1)
    stats = accumulate_pair(empty_stats(source.layout, target.layout, candidates), src, tgt,
                           [(w, w[-1:]) for w in windows], config.point)
    assignment = assign_layers(stats, source.layout, target.layout, "depth", 1)
    # A small ridge: a thousand tokens may not span the cache width.
    return solve_translator(stats, assignment, source.layout, target.layout, config.point, ridge=1e-3)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout is reserved for --json
    )
