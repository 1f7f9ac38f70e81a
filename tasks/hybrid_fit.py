"""`kvlingo fit` for pairs with a hybrid side (Gated DeltaNet or Kimi Delta Attention linear-attention layers
beside attention layers).

Units of work on a `tasks.fit.FitPlan` (same samples, split, fingerprint, run directory and data manifest as
every fit): closed forms of every state strategy the pair admits (`translators.hybrid`: attention K/V maps by
relative depth, ν = 1; per linear layer zero, copy, copy + correction or replay; `token_identity` appends the
target's embedding of each token to every map), the closed form chosen by KL on
the selection conversations, stage 2 from it with checkpoint selection on the same conversations, validation KL
of all of them beside the empty-prefix and random-map controls, and both artifacts
(`translators.hybrid_artifact`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from typing import Any

from infra.config import FitConfig
from translators.errors import ConfigError
from translators.states import linear_layers

# Settings of the GQA/MLA fit that hybrid closed forms do not take (their maps are fixed by `translators.hybrid`).
GQA_ONLY = ("assignment", "nu", "ridge", "head_wise", "weighting", "objective", "ce_weight",
            "workers", "gpu", "ray_address", "seeds")
RIDGE_KV = 1e-4  # K/V and replay maps: ridge relative to the mean diagonal (`infra.hybrid_fit`'s measurements)


def check_hybrid_config(config: FitConfig, source, target, same_tokenizer: bool) -> None:
    """Refuse, all at once, settings a hybrid fit cannot honour.

    Raises:
        ConfigError: a GQA-only setting away from its default, or two tokenizers.
    """
    problems = [f"{name}={getattr(config, name)!r}" for name in GQA_ONLY
                if getattr(config, name) != FitConfig.model_fields[name].default]
    if not same_tokenizer:
        problems.append(f"{source.name} and {target.name} tokenize differently (hybrid fits need one tokenizer)")
    if problems:
        sides = ", ".join(f"{m.name} (linear layers {linear_layers(m.layout)})" for m in (source, target)
                          if linear_layers(m.layout))
        raise ConfigError(f"{sides}: hybrid caches are fitted by their own closed forms (attention K/V maps by "
                          f"relative depth, ν = 1; one state strategy per linear layer); these settings do not "
                          f"apply, leave them at their defaults:\n  " + "\n  ".join(problems))


def pair_strategies(source_layout, target_layout) -> list[str]:
    """The state strategies a pair admits: ``translated`` (K/V only) into a target without linear layers;
    else ``zero`` and ``replay``, with ``copy`` and ``copy_corrected`` when the states share one geometry."""
    from translators.states import COPY, CORRECTED, REPLAY, ZERO, same_state_geometry

    if not linear_layers(target_layout):
        return ["translated"]
    if same_state_geometry(source_layout, target_layout):
        return [ZERO, COPY, CORRECTED, REPLAY]
    return [ZERO, REPLAY]


def fit_closed_forms(plan, stats: list, select: list) -> tuple[dict, dict[str, Any]]:
    """Every strategy's closed form from the ``stats`` samples; ``selected`` (corrections per layer) on
    ``select`` where the pair can copy.

    Returns:
        ({strategy: HybridTranslator}, {"kv_r2", "replay_r2", "state_fit"} held-out fit scores on ``select``, and
        "correction_strengths" {layer: the strength `select_corrections` kept, 0 for a copy} where it ran).
    """
    from translators.hybrid import (
        attach_token_identity,
        fit_kv_maps,
        fit_replay_maps,
        fit_states,
        make_translator,
        paired_captures,
        select_corrections,
        strategies_for,
    )
    from translators.states import CORRECTED, REPLAY, read_metric

    src, tgt, point = plan.source, plan.target, plan.config.point
    prompts = [p[:-1] for p, _ in stats]
    src_caps, tgt_caps = paired_captures(src.model, src.layout, tgt.model, tgt.layout, prompts, point)
    translators, scores, kv = {}, {}, None
    for strategy in pair_strategies(src.layout, tgt.layout):
        chosen = {} if strategy == "translated" else strategies_for(tgt.layout, strategy)
        translator = make_translator(src.layout, tgt.layout, tgt.model, chosen, point,
                                     token_identity=plan.config.token_identity)
        attach_token_identity(translator, src.model, src.layout, tgt.model)
        if kv is None:
            scores["kv_r2"] = [asdict(f) for f in fit_kv_maps(translator, src_caps, tgt_caps, ridge=RIDGE_KV)]
            kv = {k: v.detach().clone() for k, v in translator.kv.items()}
        translator.kv.load_state_dict(kv)
        if strategy == CORRECTED:
            metrics = read_metric(tgt.model, tgt.layout, prompts)
            fits = fit_states(translator, src_caps, tgt_caps, ridge=plan.config.state_ridge, metrics=metrics)
            scores["state_fit"] = [asdict(f) for f in fits]
        if strategy == REPLAY:
            scores["replay_r2"] = [asdict(f) for f in fit_replay_maps(translator, tgt.model, src_caps, prompts,
                                                                      ridge=RIDGE_KV)]
        translators[strategy] = translator
    if CORRECTED in translators and select:
        translators["selected"], _, trace = select_corrections(src.model, src.layout, tgt.model, tgt.layout,
                                                               translators[CORRECTED], select)
        scores["correction_strengths"] = {str(t): row["strength"] for t, row in trace.items()}
    return translators, scores


def _sample_kls(plan, samples: list, translator):
    """`ValidationKL` of ``translator`` on ``samples`` (its `per_sample` pairs candidates scored on them)."""
    from translators.hybrid import hybrid_validation_kl

    src, tgt = plan.source, plan.target
    return hybrid_validation_kl(src.model, src.layout, tgt.model, tgt.layout, samples, translator)


def _mean_kl(plan, samples: list, translator) -> float:
    return _sample_kls(plan, samples, translator).mean


def choose_closed_form(plan, translators: dict, select: list) -> tuple[str, dict[str, float]]:
    """The strategy with the lowest mean KL on ``select`` (ties: the earlier one), and every score; without
    selection conversations ``copy`` where the pair has it (it beat replay on the embedded GDN pair, README),
    else ``replay``, else ``translated``."""
    if not select:
        fallback = [name for name in ("translated", "replay", "copy") if name in translators]
        return fallback[-1], {}
    scores = {name: _mean_kl(plan, select, tr) for name, tr in translators.items()}
    return min(scores, key=lambda name: (scores[name], list(scores).index(name))), scores


def distill_with_selection(plan, closed_form, train: list, select: list) -> tuple[Any, dict[str, Any]]:
    """Stage 2 from ``closed_form`` (a copy) for config.steps steps; every eval_every steps the translator is
    scored on ``select``, and the checkpoint `translators.checkpoint_selection.choose_checkpoint` picks is returned,
    as `kvlingo fit` does: the last step unless an earlier one, the closed form (step 0) included, is better beyond
    the selection set's noise. The candidates' states are kept in memory (one per eval_every steps).

    Raises:
        NonFiniteError: a non-finite loss (lower the learning rate).
    """
    from translators.checkpoint_selection import MARGIN_SE, choose_checkpoint
    from translators.hybrid import distill_hybrid

    cfg = plan.config
    src, tgt = plan.source, plan.target
    student = copy.deepcopy(closed_form)
    scores = {0: _sample_kls(plan, select, closed_form)} if select else {}
    states = {0: copy.deepcopy(closed_form.state_dict())}

    def checkpoint(step: int) -> None:
        if select and (step % cfg.eval_every == 0 or step == cfg.steps):
            scores[step] = _sample_kls(plan, select, student)
            states[step] = copy.deepcopy(student.state_dict())

    started = time.perf_counter()
    losses = distill_hybrid(student, src.model, src.layout, tgt.model, tgt.layout, train, steps=cfg.steps, lr=cfg.lr,
                            batch=cfg.batch, seed=cfg.seed, on_step=checkpoint)
    chosen = cfg.steps
    if select:
        chosen = choose_checkpoint({step: kl.per_sample for step, kl in scores.items()})
        student.load_state_dict(states[chosen])
    return student, {"selected_step": chosen, "selection_kl": {str(k): v.mean for k, v in scores.items()},
                     "margin_se": MARGIN_SE, "final_loss": losses[-1], "seconds": round(time.perf_counter() - started, 1)}


def fit_hybrid(plan) -> dict[str, Any]:
    """The whole hybrid fit on ``plan``; writes closed_form/ and (without stage1_only) distilled/ under plan.out.

    Returns:
        the JSON summary (``hybrid: true``; ``val_kl`` / ``val_kl_se`` / ``first_token_kl`` per condition).
    """
    from tasks.fit import selection_size
    from translators.hybrid import hybrid_validation_kl, random_like
    from translators.hybrid_artifact import save_hybrid_translator

    cfg = plan.config
    src, tgt = plan.source, plan.target
    train = [(s.prefix_ids, s.continuation_ids) for s in plan.train]
    val = [(s.prefix_ids, s.continuation_ids) for s in plan.val]
    n_select = selection_size(cfg)
    select = train[-n_select:] if n_select else []
    pool = train[:-n_select] if n_select else train
    stats = pool[:cfg.stats_samples] if cfg.stats_samples else pool
    translators, fit_scores = fit_closed_forms(plan, stats, select)
    chosen, selection = choose_closed_form(plan, translators, select)
    conditions = {**translators, "closed_form": translators[chosen]}
    stage2 = None
    if not cfg.stage1_only:
        conditions["distilled"], stage2 = distill_with_selection(plan, translators[chosen], pool, select)
    final = conditions["distilled"] if "distilled" in conditions else conditions["closed_form"]
    rows = {name: hybrid_validation_kl(src.model, src.layout, tgt.model, tgt.layout, val, tr)
            for name, tr in conditions.items()}
    rows["empty_prefix"] = hybrid_validation_kl(src.model, src.layout, tgt.model, tgt.layout, val, None,
                                                condition="empty_prefix")
    rows["random_map"] = hybrid_validation_kl(src.model, src.layout, tgt.model, tgt.layout, val,
                                              random_like(final, cfg.seed))
    fit_record = {"strategies": list(translators), "closed_form_strategy": chosen, "n_stats": len(stats),
                  "n_select": len(select), "fit_scores": fit_scores}
    artifacts = {"closed_form": str(save_hybrid_translator(
        conditions["closed_form"], plan.out / "closed_form", source=plan.signatures["source"],
        target=plan.signatures["target"], fit={**fit_record, "stage": "closed_form",
                                               "val_kl": rows["closed_form"].mean}))}
    if stage2 is not None:
        artifacts["distilled"] = str(save_hybrid_translator(
            conditions["distilled"], plan.out / "distilled", source=plan.signatures["source"],
            target=plan.signatures["target"], fit={**fit_record, "stage": "distilled", "steps": cfg.steps,
                                                   "lr": cfg.lr, **stage2, "val_kl": rows["distilled"].mean}))
    return {
        "hybrid": True, "source": src.name, "target": tgt.name, "fingerprint": plan.fingerprint,
        **fit_record, "closed_form_selection_kl": selection, "stage2": stage2,
        "n_train": len(train), "n_val": len(val),
        "val_kl": {name: row.mean for name, row in rows.items()},
        "val_kl_se": {name: row.se for name, row in rows.items()},
        "first_token_kl": {name: row.first_token for name, row in rows.items()},
        "artifacts": artifacts, "artifact": artifacts.get("distilled", artifacts["closed_form"]),
    }
