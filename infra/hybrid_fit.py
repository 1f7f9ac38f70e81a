"""Closed-form translators into and out of the embedded hybrids (GDN, KDA), one per state strategy, with validation KL.

``python -m infra.hybrid_fit kvlingo-tiny-l-gdn kvlingo-tiny-s-gdn --json`` (or a GQA model on either side, e.g.
``kvlingo-tiny-l kvlingo-tiny-s-gdn``) loads both models (built on first use), captures both on the same embedded
conversations (one conversation per capture), fits the target's attention K/V maps (ridge, ν = 1), the replay
maps and, between same-geometry hybrids, the bilinear state + affine conv-window corrections in closed form, and
reports validation KL of the target's answers under each state strategy the pair admits (`fit_report`) beside
the ``empty_prefix`` and ``random_map`` controls, and ``native_states`` (the translated K/V of the copy or
replay translator with the target's own states: what the state corrections regress onto).
``--token-identity ids|codebook`` appends the target's embedding of each token to every map (e.g.
``kvlingo-tiny-l-mla kvlingo-tiny-kda``, the MLA → KDA pair).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

FIT_SEED = 3  # synthetic-chat stream of the fit conversations
VALIDATION_SEED = 4  # a different stream for validation


def _samples(tokenizer, count: int, seed: int):
    """(prefix, continuation) id pairs cut at one assistant turn of ``count`` embedded conversations."""
    from infra.samples import chat_samples
    from infra.synthetic_chat import generate_conversations

    return [(s.prefix_ids, s.continuation_ids)
            for s in chat_samples(generate_conversations(count, seed), tokenizer, seed=seed)]


def recall_scores(src, tgt, translators: dict, n_items: int) -> dict[str, dict]:
    """Recall on ``n_items`` held-out embedded items (`infra.synthetic_chat.recall_items`, kinds fact / needle /
    qa) per condition: ``target_native``, ``source_native``, each translator, ``empty_prefix``.

    Each row: {"score": share correct, "se": its standard error, "n": items}; an answer is the target's greedy
    reply (12 tokens at most), judged by `recall_hit`.
    """
    import torch

    from infra.chat import stop_ids
    from infra.synthetic_chat import recall_hit, recall_items
    from infra.tiny_models import HELDOUT_SEED, render_chat
    from translators.generation import GenerationSettings
    from translators.hybrid import hybrid_answer

    items = recall_items(n_items, HELDOUT_SEED)
    settings = GenerationSettings(max_new_tokens=12, stop_ids=tuple(stop_ids(tgt.tokenizer)))
    prompts = [torch.tensor(tgt.tokenizer(render_chat(item.messages, add_generation_prompt=True),
                                          add_special_tokens=False)["input_ids"]) for item in items]
    conditions = {"target_native": ("target_native", None), "source_native": ("source_native", None),
                  **{name: ("translated", tr) for name, tr in translators.items()},
                  "empty_prefix": ("empty_prefix", None)}
    out = {}
    for name, (condition, translator) in conditions.items():
        hits = [recall_hit(item.answer, tgt.tokenizer.decode(
            hybrid_answer(src.model, src.layout, tgt.model, tgt.layout, prompt, translator, settings,
                          condition=condition), skip_special_tokens=True)) for item, prompt in zip(items, prompts)]
        score = sum(hits) / len(hits)
        out[name] = {"score": score, "se": (score * (1 - score) / max(len(hits) - 1, 1)) ** 0.5, "n": len(hits)}
    return out


def fit_report(source_name: str, target_name: str, *, n_fit: int = 200, n_val: int = 60, ridge_kv: float = 1e-4,
               ridge_state: float | None = None, passes: int = 2, distill_steps: int = 0, distill_lr: float = 1e-3,
               recompute: Sequence[int] = (), recall: int = 0, token_identity: str | None = None,
               progress: bool = False) -> dict:
    """Fit and score every state strategy the pair admits, for one direction; returns the report dict (JSON-able).

    The strategies scored (`val_kl` keys) follow the pair: into a hybrid target always ``zero`` and ``replay``
    (the target's own mixers over inputs predicted from the source's tokens); when the source has linear layers of
    the target's state geometry also ``copy``, ``copy_corrected`` and ``selected`` (per layer the correction only
    where it lowers KL on the fit conversations held out from the state fit); into a target without linear layers
    (hybrid → GQA) only ``translated``. All share the same attention K/V maps. Controls: ``empty_prefix`` and
    ``random_map`` (the distilled translator, else the best closed form, with every map replaced by noise of the
    same norm).

    ``distill_steps`` > 0 adds ``distilled``: stage 2 (`translators.hybrid.distill_hybrid`, batches of 4 fit
    conversations) from ``selected`` where the pair can copy, else from ``replay`` (``translated`` into a GQA
    target), trained on a copy without the held-out 20% of fit conversations, which pick the best checkpoint (the
    start included; ``distill_selection``); ``distilled_minus_start`` is the paired difference of validation KL,
    distilled minus its start, per conversation (mean and standard error). Each k in ``recompute`` adds a row of the DroidSpeak baseline
    (`translators.partial_recompute`): the target recomputes its first k layers and reads the ``copy`` (else
    ``replay``) translator's objects in the rest, with the share of its prefill compute that costs. ``recall`` > 0
    adds ``recall``: `recall_scores` on that many held-out items for every translator and condition.
    ``token_identity`` ("ids" or "codebook"): every map also reads the target's embedding of each token.

    Raises:
        ConfigError: unknown model names, ridge_state <= 0, or a recompute depth outside [1, the target's layers]
            (checked before anything is fitted).
    """
    from infra.zoo import load_model
    from translators.errors import ConfigError
    from translators.hybrid import (
        attach_token_identity,
        fit_kv_maps,
        fit_replay_maps,
        fit_states,
        hybrid_validation_kl,
        make_translator,
        paired_captures,
        random_like,
        sample_kls,
        select_corrections,
        strategies_for,
    )
    from translators.stage1 import ValidationKL
    from translators.partial_recompute import compute_fraction
    from translators.states import (
        COPY,
        CORRECTED,
        REPLAY,
        ZERO,
        linear_layers,
        read_metric,
        same_state_geometry,
    )

    from infra.config import FitConfig

    if ridge_state is None:  # kvlingo fit's default, one value for both entry points
        ridge_state = FitConfig.model_fields["state_ridge"].default
    if ridge_state <= 0:
        raise ConfigError(f"ridge_state must be > 0 (the shrinkage of the state corrections towards plain copy), "
                          f"got {ridge_state}")
    started = time.perf_counter()
    src, tgt = load_model(source_name), load_model(target_name)
    source_model, tokenizer, source = src.model, src.tokenizer, src.layout
    target_model, target = tgt.model, tgt.layout
    bad = [k for k in recompute if not 1 <= k <= target.n_layers]
    if bad:
        raise ConfigError(f"--recompute {bad}: the target {target_name} has {target.n_layers} layers; "
                          f"recompute 1 to {target.n_layers} of them")
    fit = _samples(tokenizer, n_fit, FIT_SEED)
    val = _samples(tokenizer, n_val, VALIDATION_SEED)
    prompts = [p[:-1] for p, _ in fit]
    src_caps, tgt_caps = paired_captures(source_model, source, target_model, target, prompts)
    capture_seconds = time.perf_counter() - started
    held = max(1, len(fit) // 5)  # the last 20% of fit pairs score the closed forms and select the corrections
    if not linear_layers(target):
        strategies = ["translated"]
    elif same_state_geometry(source, target):
        strategies = [ZERO, COPY, CORRECTED, REPLAY]
    else:
        strategies = [ZERO, REPLAY]
    translators, kv_fits, state_fits, replay_fits, kv_state = {}, None, [], [], None
    for strategy in strategies:
        chosen = {} if strategy == "translated" else strategies_for(target, strategy)
        translator = make_translator(source, target, target_model, chosen, token_identity=token_identity)
        attach_token_identity(translator, source_model, source, target_model)
        if kv_state is None:
            kv_fits = fit_kv_maps(translator, src_caps, tgt_caps, ridge=ridge_kv, n_heldout=held)
            fit_kv_maps(translator, src_caps, tgt_caps, ridge=ridge_kv)  # refit on every pair for the translators
            kv_state = {k: v.detach().clone() for k, v in translator.kv.items()}
        else:
            translator.kv.load_state_dict(kv_state)
        if strategy == CORRECTED:
            # Fitted without the held-out pairs: they score the fit and then select the corrections. The key side
            # of the error is weighted by how the target reads its states (its queries and keys).
            metrics = read_metric(target_model, target, prompts[:-held])
            state_fits = fit_states(translator, src_caps, tgt_caps, ridge=ridge_state, passes=passes, n_heldout=held,
                                    metrics=metrics)
        if strategy == REPLAY:
            replay_fits = fit_replay_maps(translator, target_model, src_caps, prompts, ridge=ridge_kv, n_heldout=held)
            fit_replay_maps(translator, target_model, src_caps, prompts, ridge=ridge_kv)  # every pair, as K/V
        translators[strategy] = translator
    selection_trace, selection_copy_kl = {}, None
    if CORRECTED in translators:
        translators["selected"], selection_copy_kl, selection_trace = select_corrections(
            source_model, source, target_model, target, translators[CORRECTED], fit[-held:])
    start_from = next(s for s in ("selected", REPLAY, "translated") if s in translators)
    distill_seconds = None
    selection = None
    if distill_steps > 0:
        started_distill = time.perf_counter()
        translators["distilled"], selection = _distill_with_selection(
            translators[start_from], source_model, source, target_model, target, fit[:-held], fit[-held:],
            steps=distill_steps, lr=distill_lr)
        distill_seconds = round(time.perf_counter() - started_distill, 1)
    per_sample = {strategy: sample_kls(source_model, source, target_model, target, val, tr)
                  for strategy, tr in translators.items()}
    val_kl = {strategy: ValidationKL.of(*kls).summary() for strategy, kls in per_sample.items()}
    # Per-conversation KL is heavy-tailed (a few recall items carry most of it), so stage 2 against its start is
    # judged on paired differences: on kvlingo-tiny-l-mla -> kvlingo-tiny-kda (30 conversations) their standard
    # error was 0.020 nats where either mean's was 0.055.
    def minus(a: str, b: str) -> dict | None:
        """Summary of the per-conversation KL(a) − KL(b) (mean and first token), or None unless both ran."""
        if a not in per_sample or b not in per_sample:
            return None
        (a_means, a_firsts), (b_means, b_firsts) = per_sample[a], per_sample[b]
        return ValidationKL.of([x - y for x, y in zip(a_means, b_means)],
                               [x - y for x, y in zip(a_firsts, b_firsts)]).summary()

    distill_delta = minus("distilled", start_from)
    # The correction against plain copy, paired the same way: per-build differences are small against either mean's SE.
    corrected_minus_copy = minus(CORRECTED, COPY)
    base = translators[COPY] if COPY in translators else translators[start_from]
    if linear_layers(target):  # the states the corrections regress onto, under the same translated K/V as copy's
        val_kl["native_states"] = hybrid_validation_kl(source_model, source, target_model, target, val, base,
                                                       condition="native_states").summary()
    val_kl["empty_prefix"] = hybrid_validation_kl(source_model, source, target_model, target, val, None,
                                                  condition="empty_prefix").summary()
    noise_of = "distilled" if "distilled" in translators else start_from
    val_kl["random_map"] = hybrid_validation_kl(source_model, source, target_model, target, val,
                                                random_like(translators[noise_of])).summary()
    partial = [{"layers": k, "compute_fraction": compute_fraction(target_model, k),
                "val_kl": hybrid_validation_kl(source_model, source, target_model, target, val, base,
                                               recompute=k).summary()} for k in recompute]
    recall_rows = recall_scores(src, tgt, translators, recall) if recall > 0 else {}
    return {
        "source": source_name, "target": target_name, "ridge_state": ridge_state, "n_fit": len(fit), "n_val": len(val),
        "recall": recall_rows,
        "token_identity": token_identity,
        "strategies": strategies, "distilled_from": start_from if distill_steps > 0 else None,
        "random_map_of": noise_of,
        "kv_assignment": base.attention_assignment,
        "state_assignment": base.states.assignment,
        "replay_sources": translators[REPLAY].replay.sources if REPLAY in translators else {},
        "kv_r2_heldout": [asdict(f) for f in kv_fits], "state_fit_heldout": [asdict(f) for f in state_fits],
        "replay_r2_heldout": [asdict(f) for f in replay_fits],
        "selected_strategies": translators["selected"].states.strategies if "selected" in translators else None,
        "selection_copy_kl": selection_copy_kl,
        "correction_selection": {str(k): v for k, v in selection_trace.items()},
        "distill_steps": distill_steps, "distill_lr": distill_lr, "distill_seconds": distill_seconds,
        "distill_selection": selection, "distilled_minus_start": distill_delta,
        "corrected_minus_copy": corrected_minus_copy,
        "val_kl": val_kl, "partial_recompute": partial, "capture_seconds": round(capture_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _distill_with_selection(start, source_model, source, target_model, target, train: list, select: list, *,
                            steps: int, lr: float, checkpoints: int = 5) -> tuple[Any, dict]:
    """Stage 2 from a copy of ``start`` on ``train``; the translator is scored on ``select`` (fit conversations
    held out from training) at ``checkpoints`` evenly spaced steps, and the checkpoint
    `translators.checkpoint_selection.choose_checkpoint` picks is kept, ``start`` itself (step 0) included, as
    `kvlingo fit` does: the last step unless an earlier one is better beyond the selection set's noise.

    Returns:
        (translator, {"selected_step", "selection_kl": {step: mean KL}}).
    """
    import copy

    from translators.checkpoint_selection import choose_checkpoint
    from translators.hybrid import distill_hybrid, hybrid_validation_kl

    student = copy.deepcopy(start)
    every = max(1, steps // checkpoints)

    def score(translator):
        return hybrid_validation_kl(source_model, source, target_model, target, select, translator)

    scores = {0: score(student)}
    states = {0: copy.deepcopy(student.state_dict())}

    def checkpoint(step: int) -> None:
        if step % every == 0 or step == steps:
            scores[step] = score(student)
            states[step] = copy.deepcopy(student.state_dict())

    distill_hybrid(student, source_model, source, target_model, target, train, steps=steps, lr=lr,
                   on_step=checkpoint)
    chosen = choose_checkpoint({step: kl.per_sample for step, kl in scores.items()})
    student.load_state_dict(states[chosen])
    return student, {"selected_step": chosen, "selection_kl": {str(k): v.mean for k, v in scores.items()}}


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
    parser.add_argument("--ridge-state", type=float, default=None,
                        help="shrinkage of the state corrections towards plain copy, relative to the mean Gram "
                             "diagonal (default: kvlingo fit's state_ridge)")
    parser.add_argument("--recall", type=int, default=0, help="held-out recall items per condition (0: none)")
    parser.add_argument("--token-identity", choices=("ids", "codebook"), default=None,
                        help="append the target's embedding of each token to every map (shared tokenizer)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.recall < 0:
        parser.error(f"--recall must be >= 0, got {args.recall}")
    report = fit_report(args.source, args.target, n_fit=args.n_fit, n_val=args.n_val,
                        ridge_state=args.ridge_state, distill_steps=args.distill_steps, distill_lr=args.distill_lr,
                        recompute=args.recompute,
                        recall=args.recall, token_identity=args.token_identity)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        for key, row in report["val_kl"].items():
            print(f"{report['source']} -> {report['target']}  {key:>15}: val KL {row['mean']:.4f} ± {row['se']:.4f}"
                  f"  (first token {row['first_token']:.4f}, n={row['n']})")
        for key, row in report["recall"].items():
            print(f"{report['source']} -> {report['target']}  {key:>15}: recall {row['score']:.3f} ± {row['se']:.3f}"
                  f" (n={row['n']})")
        for row in report["partial_recompute"]:
            kl = row["val_kl"]
            print(f"{report['source']} -> {report['target']}  recompute {row['layers']} layers "
                  f"({row['compute_fraction']:.0%} of prefill) + copy: val KL {kl['mean']:.4f} ± {kl['se']:.4f}")
    return 0


if __name__ == "__main__":
    from infra.settings import apply_offline_defaults

    apply_offline_defaults()
    sys.exit(main())
