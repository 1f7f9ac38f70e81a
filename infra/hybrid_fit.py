"""Closed-form translators between the embedded GDN hybrids, one per state strategy, with validation KL.

``python -m infra.hybrid_fit kvlingo-tiny-l-gdn kvlingo-tiny-s-gdn --json`` loads both hybrids (built on first
use), captures both on the same embedded conversations (one conversation per capture), fits the target's
attention K/V maps (ridge, ν = 1) and the bilinear state + affine conv-window corrections in closed form, and
reports validation KL of the target's answers under each state strategy (``zero``, ``copy``,
``copy_corrected``, and ``selected``: per layer the correction only where it lowers KL on the fit conversations
held out from the state fit; all with the same K/V maps) beside the ``empty_prefix`` control.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

FIT_SEED = 3  # synthetic-chat stream of the fit conversations
VALIDATION_SEED = 4  # a different stream for validation


def _samples(tokenizer, count: int, seed: int):
    """(prefix, continuation) id pairs cut at one assistant turn of ``count`` embedded conversations."""
    from infra.samples import chat_samples
    from infra.synthetic_chat import generate_conversations

    return [(s.prefix_ids, s.continuation_ids)
            for s in chat_samples(generate_conversations(count, seed), tokenizer, seed=seed)]


def fit_report(source_name: str, target_name: str, *, n_fit: int = 200, n_val: int = 60, ridge_kv: float = 1e-4,
               ridge_state: float = 1e-3, passes: int = 2, distill_steps: int = 0, distill_lr: float = 1e-3,
               recompute: Sequence[int] = (), progress: bool = False) -> dict:
    """Fit and score the three state strategies for one direction; returns the report dict (JSON-able).

    ``distill_steps`` > 0 adds ``distilled``: stage 2 (`translators.hybrid.distill_hybrid`, batches of 4 fit
    conversations) from the ``selected`` translator, trained and scored on a copy. Each k in ``recompute`` adds a
    row of the DroidSpeak baseline (`translators.partial_recompute`): the target recomputes its first k layers and
    reads the ``copy`` translator's objects in the rest, with the share of its prefill compute that costs.

    Raises:
        ConfigError: unknown model names, models without the same state geometry (copy needs it), or a recompute
            depth outside [1, the target's layers] (checked before anything is fitted).
    """
    from infra.gdn_models import load_gdn_model
    from translators.hybrid import (
        HybridTranslator,
        fit_kv_maps,
        fit_states,
        hybrid_validation_kl,
        paired_captures,
        select_corrections,
        strategies_for,
    )
    from translators.errors import ConfigError
    from translators.layout import cache_layout
    from translators.partial_recompute import compute_fraction
    from translators.states import COPY, CORRECTED, STRATEGIES, StateMaps, read_metric

    started = time.perf_counter()
    source_model, tokenizer = load_gdn_model(source_name, progress=progress)
    target_model, _ = load_gdn_model(target_name, progress=progress)
    source, target = cache_layout(source_model), cache_layout(target_model)
    bad = [k for k in recompute if not 1 <= k <= target.n_layers]
    if bad:
        raise ConfigError(f"--recompute {bad}: the target {target_name} has {target.n_layers} layers; "
                          f"recompute 1 to {target.n_layers} of them")
    fit = _samples(tokenizer, n_fit, FIT_SEED)
    val = _samples(tokenizer, n_val, VALIDATION_SEED)
    src_caps, tgt_caps = paired_captures(source_model, source, target_model, target, [p[:-1] for p, _ in fit])
    capture_seconds = time.perf_counter() - started
    held = max(1, len(fit) // 5)  # the last 20% of fit pairs score the closed forms and select the corrections
    translators = {}
    kv_fits = state_fits = None
    for strategy in STRATEGIES:
        translator = HybridTranslator(source, target, StateMaps(source, target, strategies_for(target, strategy)))
        if kv_fits is None:
            kv_fits = fit_kv_maps(translator, src_caps, tgt_caps, ridge=ridge_kv, n_heldout=held)
            fit_kv_maps(translator, src_caps, tgt_caps, ridge=ridge_kv)  # refit on every pair for the translators
            kv_state = {k: v.detach().clone() for k, v in translator.kv.items()}
        else:
            translator.kv.load_state_dict(kv_state)
        if strategy == CORRECTED:
            # Fitted without the held-out pairs: they score the fit and then select the corrections. The key side
            # of the error is weighted by how the target reads its states (its queries and keys).
            metrics = read_metric(target_model, target, [p[:-1] for p, _ in fit[:-held]])
            state_fits = fit_states(translator, src_caps, tgt_caps, ridge=ridge_state, passes=passes, n_heldout=held,
                                    metrics=metrics)
        translators[strategy] = translator
    selected, selection_trace = select_corrections(source_model, source, target_model, target,
                                                   translators[CORRECTED], fit[-held:])
    translators["selected"] = selected
    distill_seconds = None
    if distill_steps > 0:
        import copy

        from translators.hybrid import distill_hybrid

        distilled = copy.deepcopy(selected)
        started_distill = time.perf_counter()
        distill_hybrid(distilled, source_model, source, target_model, target, fit, steps=distill_steps, lr=distill_lr)
        distill_seconds = round(time.perf_counter() - started_distill, 1)
        translators["distilled"] = distilled
    val_kl = {strategy: asdict(hybrid_validation_kl(source_model, source, target_model, target, val, tr))
              for strategy, tr in translators.items()}
    val_kl["empty_prefix"] = asdict(hybrid_validation_kl(source_model, source, target_model, target, val, None,
                                                         condition="empty_prefix"))
    partial = [{"layers": k, "compute_fraction": compute_fraction(target_model, k),
                "val_kl": asdict(hybrid_validation_kl(source_model, source, target_model, target, val,
                                                      translators[COPY], recompute=k))} for k in recompute]
    return {
        "source": source_name, "target": target_name, "n_fit": len(fit), "n_val": len(val),
        "kv_assignment": translators[COPY].attention_assignment, "state_assignment": translators[COPY].states.assignment,
        "kv_r2_heldout": [asdict(f) for f in kv_fits], "state_fit_heldout": [asdict(f) for f in state_fits],
        "selected_strategies": selected.states.strategies,
        "selection_kl": {str(k): v for k, v in selection_trace.items()},
        "distill_steps": distill_steps, "distill_lr": distill_lr, "distill_seconds": distill_seconds,
        "val_kl": val_kl, "partial_recompute": partial, "capture_seconds": round(capture_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if not depths or any(k < 1 for k in depths):
        raise argparse.ArgumentTypeError(f"layer counts must be positive integers, got {text!r}")
    return depths


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m infra.hybrid_fit SOURCE TARGET [--n-fit N] [--n-val N] [--json]``."""
    parser = argparse.ArgumentParser(prog="python -m infra.hybrid_fit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--n-fit", type=int, default=200, help="fit conversations")
    parser.add_argument("--n-val", type=int, default=60, help="validation conversations")
    parser.add_argument("--distill-steps", type=int, default=0, help="stage-2 steps from the selected translator")
    parser.add_argument("--distill-lr", type=float, default=1e-3, help="stage-2 peak learning rate")
    parser.add_argument("--recompute", type=_depths, default=(),
                        help="comma-separated k: the DroidSpeak baseline recomputing the target's first k layers")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = fit_report(args.source, args.target, n_fit=args.n_fit, n_val=args.n_val,
                        distill_steps=args.distill_steps, distill_lr=args.distill_lr, recompute=args.recompute)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        for key, row in report["val_kl"].items():
            print(f"{report['source']} -> {report['target']}  {key:>15}: val KL {row['mean']:.4f} ± {row['se']:.4f}"
                  f"  (first token {row['first_token']:.4f}, n={row['n']})")
        for row in report["partial_recompute"]:
            kl = row["val_kl"]
            print(f"{report['source']} -> {report['target']}  recompute {row['layers']} layers "
                  f"({row['compute_fraction']:.0%} of prefill) + copy: val KL {kl['mean']:.4f} ± {kl['se']:.4f}")
    return 0


if __name__ == "__main__":
    from infra.settings import apply_offline_defaults

    apply_offline_defaults()
    sys.exit(main())
