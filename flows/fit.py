"""The fit job: load pair → samples → paired capture and Gram statistics → assignment → closed-form solve →
diagnostics → artifact. Composition only; the numerics live in translators/."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.config import FitConfig, dump_config
from infra.settings import kvlingo_home
from translators.errors import ConfigError
from translators.translator import SIDES


def preflight(config: FitConfig) -> None:
    """Every check that needs no model, reported together.

    Raises:
        ConfigError: listing all problems found.
    """
    from infra.conversations import check_source
    from infra.zoo import resolve_model
    from translators.assignment import check_assignment_name

    problems = []
    for role in ("source", "target"):
        try:
            resolve_model(getattr(config, role))
        except ConfigError as err:
            problems.append(f"{role}: {err}")
    try:
        check_assignment_name(config.assignment)
    except ConfigError as err:
        problems.append(f"assignment: {err}")
    try:
        check_source(config.data)
    except ConfigError as err:
        problems.append(f"data: {err}")
    if problems:
        raise ConfigError("cannot start the fit:\n  " + "\n  ".join(problems))


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout is reserved for --json
    )


def run_fit(config: FitConfig) -> dict[str, Any]:
    """Stage 1 (stage 2 arrives with the distillation issue). Returns the public JSON summary."""
    from infra.conversations import load_conversations
    from infra.pairs import check_same_tokenizer
    from infra.samples import build_samples, check_prefix_lengths, split_by_conversation
    from infra.zoo import load_model, model_signature
    from translators.artifact import save_translator
    from translators.stage1 import (
        Side,
        assign_layers,
        candidate_layers,
        heldout_r2,
        random_like,
        solve_translator,
        validation_kl,
    )

    preflight(config)
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    source, target = load_model(config.source), load_model(config.target)
    check_same_tokenizer(source, target)
    corpus = load_conversations(config.data, limit=config.n_train + config.n_val, seed=config.seed)
    samples = build_samples(
        corpus,
        target.tokenizer,
        seed=config.seed,
        max_prefix_tokens=config.max_prefix_tokens,
        max_continuation_tokens=config.max_continuation_tokens,
        # Plain-text windows (models without a chat template) use the same caps.
        prefix_tokens=min(256, config.max_prefix_tokens),
        continuation_tokens=config.max_continuation_tokens,
    )
    for loaded in (source, target):
        check_prefix_lengths(samples, loaded.layout.max_positions, loaded.name)
    train, val = split_by_conversation(samples, val_fraction=config.n_val / (config.n_train + config.n_val), seed=config.seed)
    src, tgt = Side(source.model, source.layout), Side(target.model, target.layout)
    candidates = candidate_layers(source.layout, target.layout, config.assignment, config.nu)

    with _progress() as progress:
        stats = _accumulate(progress, "stage 1: train statistics", src, tgt, train, candidates, config)
        val_stats = _accumulate(progress, "stage 1: held-out statistics", src, tgt, val, candidates, config)
    assignment = assign_layers(stats, source.layout, target.layout, config.assignment, config.nu)
    translator = solve_translator(
        stats, assignment, source.layout, target.layout, config.point, ridge=config.ridge, head_wise=config.head_wise
    )
    r2 = heldout_r2(val_stats, translator)
    pairs = [(s.prefix_ids, s.continuation_ids) for s in val]
    kl = {
        "closed_form": validation_kl(src, tgt, pairs, translator),
        "empty_prefix": validation_kl(src, tgt, pairs, None, condition="empty_prefix"),
        "random_map": validation_kl(src, tgt, pairs, random_like(translator, seed=config.seed)),
    }
    out = Path(config.output_dir or kvlingo_home() / "runs" / f"{source.name}--{target.name}".replace("/", "_"))
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "source": source.name,
        "target": target.name,
        "stage": "closed_form",
        "val_kl": {name: v.mean for name, v in kl.items()},
        "val_kl_se": {name: v.se for name, v in kl.items()},
        "first_token_kl": {name: v.first_token for name, v in kl.items()},
        "r2": {side: sum(r2[side]) / len(r2[side]) for side in SIDES},
        "r2_per_layer": r2,
        "assignment": {side: {str(t): list(s) for t, s in assignment[side].items()} for side in SIDES},
        "n_train": len(train),
        "n_val": len(val),
        "train_tokens": stats["keys"].n_tokens,
        "artifact": str(out / "closed_form"),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    signatures = {"source": model_signature(source), "target": model_signature(target)}
    save_translator(
        translator,
        out / "closed_form",
        **signatures,
        fit={"stage": "closed_form", "config": config.model_dump(mode="json"), "val_kl": summary["val_kl"], "r2": summary["r2"]},
    )
    dump_config(config, out / "config.yaml")
    if not config.stage1_only:
        distilled, history = _stage2(config, translator, src, tgt, train, pairs, signatures, out)
        final = validation_kl(src, tgt, pairs, distilled)
        summary["val_kl"]["distilled"] = final.mean
        summary["val_kl_se"]["distilled"] = final.se
        summary["first_token_kl"]["distilled"] = final.first_token
        summary.update(stage="distilled", steps=config.steps, history=history, artifact=str(out / "distilled"))
        save_translator(
            distilled,
            out / "distilled",
            **signatures,
            fit={"stage": "distilled", "config": config.model_dump(mode="json"), "val_kl": summary["val_kl"], "steps": config.steps},
        )
        summary["wall_s"] = round(time.perf_counter() - started, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _stage2(config: FitConfig, closed_form, src, tgt, train, val_pairs, signatures, out: Path):
    """Distil from a copy of the closed-form maps (which stay saved as the stage-1 baseline)."""
    import copy

    from flows.distill import run_ray, run_single
    from translators.distill import Objective
    from translators.train import TrainSettings

    settings = TrainSettings(
        lr=config.lr,
        steps=config.steps,
        batch=config.batch,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        seed=config.seed,
        objective=Objective(config.objective, ce_weight=config.ce_weight),
    )
    run_signature = {**signatures, "settings": settings.signature(), "data": config.data, "n_train": config.n_train,
                     "point": config.point, "assignment": config.assignment, "nu": config.nu}
    train_pairs = [(s.prefix_ids, s.continuation_ids) for s in train]
    translator = copy.deepcopy(closed_form)
    checkpoints = out / "checkpoints"
    if config.workers == 1:
        with _progress() as progress:
            task = progress.add_task("stage 2: distillation", total=config.steps)
            return run_single(translator, src, tgt, train_pairs, val_pairs, settings, run_signature, checkpoints,
                              report=lambda record: progress.update(task, completed=record["step"]))
    return run_ray(translator, config.source, config.target, train_pairs, val_pairs, settings, run_signature,
                   checkpoints, workers=config.workers, ray_address=config.ray_address)


def _accumulate(progress, description, src, tgt, samples, candidates, config):
    from translators.stage1 import accumulate_pair, empty_stats

    task = progress.add_task(description, total=len(samples))
    stats = empty_stats(src.layout, tgt.layout, candidates)
    return accumulate_pair(
        stats, src, tgt, (s.prefix_ids for s in samples), config.point, on_sample=lambda _n: progress.advance(task)
    )
