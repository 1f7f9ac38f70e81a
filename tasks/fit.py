"""Units of work of the fit: plan (load pair, samples, fingerprint, run directory), Gram statistics per shard,
closed-form solve with diagnostics and artifact, stage-2 distillation. Plain functions: flows/fit.py composes
them in one process, flows/pipeline.py as Prefect tasks (tasks/prefect_tasks.py). The numerics live in
translators/."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.config import FitConfig, dump_config
from infra.data_manifest import build_manifest
from infra.fingerprint import fingerprint, fingerprint_fields
from infra.rundirs import run_dir
from tasks.stats_store import mark_used, store_root
from translators.errors import ConfigError
from translators.layout import is_hybrid
from translators.objects import object_names
from translators.stage1 import ReferenceMemo


def preflight(config: FitConfig) -> None:
    """Every check that needs no model, reported together.

    Raises:
        ConfigError: listing all problems found.
    """
    from infra.conversations import check_source
    from infra.zoo import pair_problems
    from translators.assignment import check_assignment_name

    problems = pair_problems(config.source, config.target)
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


def progress_bars() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout is reserved for --json
        refresh_per_second=2,  # rich's 10 redraws a second compete with the fit for 2 cores
    )


@dataclass
class FitPlan:
    """Everything a fit needs once models are loaded and samples are built (shared by the CLI and Prefect)."""

    config: FitConfig
    source: Any  # infra.zoo.LoadedModel
    target: Any
    train: list
    val: list
    candidates: dict[int, tuple[int, ...]]  # {} for a hybrid pair (`tasks.hybrid_fit`)
    nu: int | None  # source layers per target layer: config.nu, or `translators.stage1.default_nu` of the pair
    # (None for a hybrid pair)
    out: Path
    signatures: dict[str, Any]
    data_manifest: dict[str, Any]  # infra.data_manifest.build_manifest of the train/val split
    fingerprint_fields: dict[str, Any]  # infra.fingerprint.fingerprint_fields of the config, pair and data
    started: float = field(default_factory=time.perf_counter)
    token_identity: Any = None  # translators.token_identity.TokenIdentity when config.token_identity is set
    hybrid: bool = False  # a side has linear-attention layers: fitted by `tasks.hybrid_fit`
    # The target's logits and the source's captures of the validation conversations, kept from the closed form's
    # scores through stage 2's and the distilled translator's (they do not depend on the translator).
    val_memo: ReferenceMemo = field(default_factory=ReferenceMemo)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.fingerprint_fields)

    def stage2_fields(self, config: FitConfig) -> dict[str, Any]:
        """Fingerprint fields of one stage-2 run of this plan (a sweep cell or seed overrides lr and seed)."""
        return {**self.fingerprint_fields, "config": fingerprint_fields(
            config.model_dump(mode="json"), self.signatures, self.data_manifest["manifest_sha256"])["config"]}

    @property
    def sides(self):
        from translators.stage1 import Side

        return Side(self.source.model, self.source.layout), Side(self.target.model, self.target.layout)

    @property
    def stats_train(self) -> list:
        """The training samples stage 1 reads: the first `stats_samples` of them (all when None)."""
        return self.train[: self.config.stats_samples] if self.config.stats_samples else self.train

    @property
    def val_pairs(self) -> list:
        return model_inputs(self.val)

    @property
    def cross_tokenizer(self) -> bool:
        from translators.cross import CrossSample

        return bool(self.train) and isinstance(self.train[0], CrossSample)


def model_inputs(samples: list) -> list:
    """What the numerical core reads of each sample: (prefix ids, continuation ids) for a same-tokenizer pair, the
    cross-tokenizer sample itself (both renderings and their alignment) otherwise."""
    from translators.cross import CrossSample

    return [s if isinstance(s, CrossSample) else (s.prefix_ids, s.continuation_ids) for s in samples]


def plan_fit(config: FitConfig, loader=None) -> FitPlan:
    """Validate, load the pair (through `loader`, default infra.zoo.load_model), build and split samples.

    Raises:
        ConfigError (all problems at once), PairMismatchError (tokenizers), PrefixTooLongError, ModelUnavailableError.
    """
    from infra.pairs import same_tokenizer
    from infra.zoo import load_model, model_signature
    from translators.stage1 import candidate_layers, default_nu

    preflight(config)
    loader = loader or load_model
    torch.manual_seed(config.seed)
    source, target = loader(config.source), loader(config.target)
    hybrid = is_hybrid(source.layout) or is_hybrid(target.layout)
    if hybrid:
        # Hybrid caches take their own closed forms (`tasks.hybrid_fit`): no per-layer candidates, no ν.
        from tasks.hybrid_fit import check_hybrid_config

        check_hybrid_config(config, source, target, same_tokenizer(source, target))
        nu, candidates = None, {}
    else:
        if config.state_ridge != FitConfig.model_fields["state_ridge"].default:
            raise ConfigError(f"state_ridge={config.state_ridge!r}: {config.source} and {config.target} cache no "
                              f"recurrent states (state_ridge shrinks the state corrections of hybrid pairs); leave "
                              f"it at its default, or use ridge for the K/V maps")
        nu = config.nu if config.nu is not None else default_nu(source.layout, target.layout)
        candidates = candidate_layers(source.layout, target.layout, config.assignment, nu)
    config, train, val, manifest = fit_split(config, source, target)
    signatures = {"source": model_signature(source), "target": model_signature(target)}
    fields = fingerprint_fields(config.model_dump(mode="json"), signatures, manifest["manifest_sha256"])
    out = Path(config.output_dir) if config.output_dir else run_dir(source.name, target.name, fingerprint(fields))
    claim_run_dir(out, fields, resume=config.resume)
    dump_config(config, out / "config.yaml")
    (out / "data_manifest.json").write_text(json.dumps(manifest, indent=1))
    tokens = None
    if config.token_identity and not hybrid:
        from translators.token_identity import make_token_identity

        tokens = make_token_identity(config.token_identity, source.model, source.layout, target.model, config.point)
    return FitPlan(config, source, target, train, val, candidates, nu, out, signatures, manifest, fields,
                   token_identity=tokens, hybrid=hybrid)


def fit_split(config: FitConfig, source, target) -> tuple[FitConfig, list, list, dict[str, Any]]:
    """The samples of ``config`` on a loaded pair, split as the fit splits them.

    Returns:
        (config with its token-identity variant resolved, training samples, validation samples, the data manifest
        (`infra.data_manifest.build_manifest`) of the split).
    Raises:
        ConfigError (the codebook across tokenizers), PairMismatchError, PrefixTooLongError.
    """
    from infra.conversations import load_conversations
    from infra.pairs import same_tokenizer
    from infra.samples import build_samples, check_prefix_lengths, split_by_conversation

    corpus = load_conversations(config.data, limit=config.n_train + config.n_val, seed=config.seed)
    shared_tokens = same_tokenizer(source, target)
    both_gqa = object_names(source.layout) == object_names(target.layout) == ("keys", "values")
    # The run records the variant it used, so its config, fingerprint and manifest say what was fitted.
    config = config.model_copy(update={"token_identity": resolve_token_identity(config, shared_tokens, both_gqa)})
    if shared_tokens:
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
    else:
        if config.token_identity == "codebook":
            from translators.cross import CROSS_CODEBOOK_ERROR

            raise ConfigError(f"{source.name} and {target.name} tokenize differently: {CROSS_CODEBOOK_ERROR}")
        samples = _cross_samples(config, corpus, source, target)
    train, val = split_by_conversation(samples, val_fraction=config.n_val / (config.n_train + config.n_val), seed=config.seed)
    return config, train, val, build_manifest(corpus, train, val)


def resolve_token_identity(config: FitConfig, shared_tokens: bool, both_gqa: bool) -> str | None:
    """The token identity a fit uses: the configured variant, or for "auto" the codebook where it was measured to
    help (one tokenizer, GQA K/V caches on both sides, maps that mix heads; see FitConfig.token_identity) and
    none elsewhere."""
    if config.token_identity != "auto":
        return config.token_identity
    return "codebook" if shared_tokens and both_gqa and not config.head_wise else None


def _cross_samples(config: FitConfig, corpus, source, target) -> list:
    """Cross-tokenizer samples (App. K): each model renders a chat corpus's conversations in its own format; a
    text corpus (long documents) gives plain-text windows both models read. The source may need more tokens than
    the target for the same text, hence half the shorter model's positions for a text window.

    Raises:
        ConfigError: no usable sample.
        AlignmentError: a tokenizer without character offsets.
    """
    from infra.cross_samples import cross_chat_samples, cross_text_samples

    limit = min(source.layout.max_positions, target.layout.max_positions)
    if corpus.kind != "chat":  # long documents: plain-text windows read by both models (App. K alignment)
        return cross_text_samples(corpus.items, source.tokenizer, target.tokenizer, seed=config.seed,
                                  prefix_tokens=min(config.max_prefix_tokens, limit // 2 - config.max_continuation_tokens),
                                  continuation_tokens=config.max_continuation_tokens)
    return cross_chat_samples(corpus.items, source.tokenizer, target.tokenizer, seed=config.seed,
                              max_prefix_tokens=min(config.max_prefix_tokens, limit - config.max_continuation_tokens),
                              max_continuation_tokens=config.max_continuation_tokens)


def claim_run_dir(out: Path, fields: dict[str, Any], *, resume: bool) -> None:
    """Make `out` this run's directory: refuse one that holds another run (unless `resume` is False, which
    clears that run's checkpoints and results), then record the fingerprint.

    Raises:
        ConfigError: `out` holds a run with another fingerprint, naming the fields that differ.
    """
    from infra.fingerprint import describe_differences

    record = out / "fingerprint.json"
    if record.is_file():
        old = json.loads(record.read_text())
        if old["fingerprint"] != fingerprint(fields):
            if resume:
                raise ConfigError(
                    f"{out} holds another run ({describe_differences(old['fields'], fields)}): its checkpoints and "
                    "artifacts belong to that config. Drop --output-dir (each fingerprint gets its own directory), "
                    "pick another one, or pass --no-resume to replace that run."
                )
    if not resume:
        for name in ("checkpoints", "sweep", "closed_form", "distilled", "summary.json", "seeds"):
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"fingerprint": fingerprint(fields), "fields": fields}, indent=1, default=str))


def stats_key(plan: FitPlan, samples: list) -> str:
    """Content address of the statistics of `samples` for this pair, point and candidate set."""
    from translators.gram import FORMAT

    h = hashlib.sha256()
    # The file format is part of the address: shards of an older layout are recomputed, never misread.
    setup = [FORMAT, plan.signatures, plan.config.point, plan.config.weighting, sorted(plan.candidates.items())]
    if plan.config.token_identity:  # the token features are part of every statistic
        setup.append(plan.config.token_identity)
    h.update(json.dumps(setup, sort_keys=True, default=str).encode())
    for sample in samples:
        if plan.cross_tokenizer:
            h.update(sample.fingerprint_bytes())
            continue
        h.update(sample.prefix_ids.numpy().tobytes())
        if plan.config.weighting == "attention":  # the weights depend on the continuation too
            h.update(b"+" + sample.continuation_ids.numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:24]


# Training (and held-out) samples are accumulated in contiguous shards of this many samples, each stored under its
# own content address: a fit killed during stage 1 loses at most the shard in progress, and a re-run reads the
# finished shards back. The shard boundaries are a function of the sample list alone (not of the machine or of
# how far an earlier attempt got), so the merged statistics — and the closed form — are bit-identical whether
# the shards were computed in one go or across interruptions.
STATS_SHARD_SIZE = 32


def shard_samples(samples: list, size: int = STATS_SHARD_SIZE) -> list[list]:
    """Contiguous shards of `size` samples (the last one may be shorter); none for an empty list.

    Raises:
        ConfigError: size < 1.
    """
    if size < 1:
        raise ConfigError(f"a statistics shard holds at least one sample, got size {size}")
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def stats_store(plan: FitPlan, samples: list) -> Path:
    """Where the statistics of `samples` live in the content-addressed store."""
    return store_root() / stats_key(plan, samples)


def stats_stored(plan: FitPlan, samples: list) -> bool:
    """True when the statistics of `samples` are already in the store (a finished shard)."""
    store = stats_store(plan, samples)
    return all((store / f"{name}.safetensors").is_file() for name in object_names(plan.target.layout))


def shard_stats(plan: FitPlan, samples: list, progress=None, description: str = "stage 1: statistics",
                task=None) -> dict:
    """Gram statistics of `samples`, read from the content-addressed store when already accumulated.

    Progress goes to `task` of `progress` when given (one bar over several shards), else to a new task.
    A shard is written to a temporary directory and renamed into place, so a killed process never leaves a
    half-written shard under its final name.
    """
    from translators.cross import accumulate_samples
    from translators.gram import GramStats
    from translators.stage1 import empty_stats

    store = stats_store(plan, samples)
    if stats_stored(plan, samples):
        if progress is not None and task is not None:
            progress.advance(task, len(samples))
        mark_used(store)
        return {name: GramStats.load(store / f"{name}.safetensors") for name in object_names(plan.target.layout)}
    src, tgt = plan.sides
    tokens = plan.token_identity
    stats = empty_stats(plan.source.layout, plan.target.layout, plan.candidates,
                        token_width=tokens.width if tokens else 0)
    if progress is not None and task is None:
        task = progress.add_task(description, total=len(samples))
    accumulate_samples(stats, src, tgt, model_inputs(samples), plan.config.point, weighting=plan.config.weighting,
                       on_sample=(lambda _n: progress.advance(task)) if progress is not None else None,
                       token_identity=tokens)
    # A temporary directory of this process and thread: two fits of the same pair (threads of a Prefect flow, or
    # a CLI fit beside a sweep) may finish the same shard at once. The content address makes their results
    # identical, so whichever rename lands first wins and the other discards its copy.
    store_shard(plan, samples, stats)
    return stats


def store_shard(plan: FitPlan, samples: list, stats: dict) -> None:
    """Write one shard's statistics under its content address (temporary directory, then rename)."""
    store = stats_store(plan, samples)
    tmp = store.with_name(f"{store.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.mkdir(parents=True)
    for name, object_stats in stats.items():
        object_stats.save(tmp / f"{name}.safetensors")
    try:
        os.replace(tmp, store)
    except OSError:  # the store directory exists and is not empty: another writer finished first
        shutil.rmtree(tmp)


def sharded_stats(plan: FitPlan, samples: list, progress=None, description: str = "stage 1: statistics",
                  size: int = STATS_SHARD_SIZE) -> tuple[dict, dict[str, int]]:
    """Statistics of `samples` accumulated shard by shard (`shard_samples`), finished shards read from the
    store, summed in shard order one shard at a time. Returns the statistics and {"shards", "reused", "computed"}.

    Raises:
        ConfigError: no samples.
    """
    shards = shard_samples(samples, size)
    if not shards:
        raise ConfigError(f"{description}: no samples to accumulate")
    reused = sum(stats_stored(plan, shard) for shard in shards)
    task = progress.add_task(description, total=len(samples)) if progress is not None else None
    if reused < len(shards) and _on_ray(plan.config):
        ray_shard_stats(plan, shards, progress, task)  # stores every missing shard; the sum below reads them back
        task = None
    stats = merge_stats(shard_stats(plan, shard, progress, description, task=task) for shard in shards)
    return stats, {"shards": len(shards), "reused": reused, "computed": len(shards) - reused}


def _on_ray(config: FitConfig) -> bool:
    from tasks.cluster import use_ray

    return use_ray(config.workers, config.ray_address)


def ray_shard_stats(plan: FitPlan, shards: list[list], progress=None, task=None) -> None:
    """Compute the statistics of every shard not yet in the store on `config.workers` Ray actors (tasks/cluster.py)
    that load the pair once, and store each under its content address as it arrives. The sums equal
    `shard_stats`'s bit for bit (same weights, checked by signature; same kernels).

    Raises:
        ClusterError: the cluster cannot be reached or a worker failed. PairMismatchError: a worker holds other weights.
    """
    from tasks.cluster import ordered_map, workers_for

    config = plan.config
    todo = [i for i, shard in enumerate(shards) if not stats_stored(plan, shard)]
    actors = workers_for(config.source, config.target, workers=config.workers, address=config.ray_address,
                         signatures=plan.signatures, use_gpu=config.gpu)
    spec = {"candidates": plan.candidates, "point": config.point, "weighting": config.weighting,
            "token_identity": config.token_identity}

    def finished(k: int, stats: dict) -> None:
        store_shard(plan, shards[todo[k]], stats)
        if progress is not None and task is not None:
            progress.advance(task, len(shards[todo[k]]))

    ordered_map(actors, "gram_shard", [model_inputs(shards[i]) for i in todo], spec, on_result=finished)
    if progress is not None and task is not None:  # the shards that were already stored
        progress.advance(task, sum(len(shard) for shard in shards) - sum(len(shards[i]) for i in todo))


def merge_stats(parts: Iterable[dict]) -> dict:
    """Partial statistics of disjoint shards sum exactly to the one-pass statistics. Folded one part at a time, so
    a generator of parts keeps only the running sum and one shard in memory (each shard's statistics are as large
    as the sum: holding every shard of a 1024-conversation fit at once took SmolLM2 → Gemma-3 past 24 GB).

    Raises:
        ConfigError: no parts.
    """
    total = None
    for part in parts:
        total = part if total is None else {name: total[name].merge(part[name]) for name in total}
    if total is None:
        raise ConfigError("no statistics to merge")
    return total


def codebook_accuracy_on(plan: FitPlan, pairs: list) -> float:
    """Share of the held-out prefixes' tokens the codebook decodes from the source's layer-0 cache."""
    from translators.capture import capture

    codebook = plan.token_identity.codebook()
    hits = total = 0
    with torch.no_grad():
        for prefix, _continuation in pairs:
            cap = capture(plan.source.model, plan.source.layout, prefix, plan.config.point)
            decoded = codebook.decode(cap.objects[codebook.object][0]).cpu()
            hits += int((decoded == prefix.cpu()).sum())
            total += prefix.numel()
    return hits / total


def solve_closed_form(plan: FitPlan, stats: dict, val_stats: dict) -> tuple[Any, dict[str, Any]]:
    """Assignment, closed-form maps, held-out R², validation KL beside the two controls; saves the artifact."""
    from translators.artifact import save_translator
    from translators.cross import alignment_summary, validation_kl_for as validation_kl
    from translators.quality import record_quality
    from translators.stage1 import assign_layers, heldout_r2, random_like, solve_translator

    config = plan.config
    src, tgt = plan.sides
    assignment = assign_layers(stats, plan.source.layout, plan.target.layout, config.assignment, plan.nu)
    translator = solve_translator(
        stats, assignment, plan.source.layout, plan.target.layout, config.point, ridge=config.ridge,
        head_wise=config.head_wise, token_identity=config.token_identity,
    )
    translator.token_module = plan.token_identity
    r2 = heldout_r2(val_stats, translator)
    pairs = plan.val_pairs
    memo = plan.val_memo
    kl = {
        "closed_form": validation_kl(src, tgt, pairs, translator, memo=memo),
        "empty_prefix": validation_kl(src, tgt, pairs, None, condition="empty_prefix", memo=memo),
        "random_map": validation_kl(src, tgt, pairs, random_like(translator, seed=config.seed), memo=memo),
    }
    if plan.cross_tokenizer:  # the target's own boilerplate alone (BOS, headers): what translated content adds to
        kl["boilerplate_only"] = validation_kl(src, tgt, pairs, None, condition="boilerplate_only", memo=memo)
    # How faithfully the target reads this translator's cache, per prefix length, with a calibrated floor: what the
    # serving gate reads before loading (translators/quality.py); in the manifest and the summary.
    quality = record_quality(src, tgt, pairs, translator)
    extra = {"quality": {"closed_form": quality}}
    if config.token_identity == "codebook":  # how much of the prompt the source's cache gives away (privacy)
        extra["codebook_accuracy"] = codebook_accuracy_on(plan, pairs)
    summary = {
        "source": plan.source.name,
        "target": plan.target.name,
        "stage": "closed_form",
        "val_kl": {name: v.mean for name, v in kl.items()},
        "val_kl_se": {name: v.se for name, v in kl.items()},
        "first_token_kl": {name: v.first_token for name, v in kl.items()},
        "r2": {name: sum(values) / len(values) for name, values in r2.items()},
        "r2_per_layer": r2,
        **extra,
        "assignment": {name: {str(t): list(s) for t, s in layers.items()} for name, layers in assignment.items()},
        "nu": plan.nu,
        "n_train": len(plan.train),
        "n_stats": len(plan.stats_train),
        "n_val": len(plan.val),
        "train_tokens": next(iter(stats.values())).n_tokens,
        # Fixed by the pair and candidate set, not by the data: the statistics hold sums, never design matrices.
        "stats_mb": sum(object_stats.nbytes for object_stats in stats.values()) / 2**20,
        "artifact": str(plan.out / "closed_form"),
        "artifacts": {"closed_form": str(plan.out / "closed_form")},
        "run_dir": str(plan.out),
        "fingerprint": plan.fingerprint,
        "data_manifest": {k: v for k, v in plan.data_manifest.items() if k not in ("train", "val")},
    }
    if plan.cross_tokenizer:
        summary["alignment"] = alignment_summary(plan.train)
    save_translator(
        translator,
        plan.out / "closed_form",
        **plan.signatures,
        fit={"stage": "closed_form", "config": config.model_dump(mode="json"), "val_kl": summary["val_kl"], "r2": summary["r2"],
             "fingerprint": plan.fingerprint, "data_manifest": plan.data_manifest, "quality": quality,
             **({"alignment": summary["alignment"]} if "alignment" in summary else {})},
    )
    return translator, summary


def distill(
    plan: FitPlan, closed_form, summary: dict[str, Any], *, lr: float | None = None, seed: int | None = None,
    cell_dir: Path | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Stage 2 from the closed-form maps; adds val_kl.distilled, steps and the history to the summary.

    A sweep cell overrides the learning rate and seed and writes into its own `cell_dir` (its checkpoints make
    a re-run of a finished cell free).
    """
    from translators.artifact import save_translator
    from translators.checkpoint_selection import paired_difference
    from translators.cross import validation_kl_for as validation_kl
    from translators.quality import record_quality

    updates = {k: v for k, v in (("lr", lr), ("seed", seed)) if v is not None}
    config = plan.config.model_copy(update=updates)
    out = Path(cell_dir) if cell_dir else plan.out
    src, tgt = plan.sides
    fields = plan.stage2_fields(config)
    n_select = selection_size(config)
    train = plan.train[:len(plan.train) - n_select]
    distilled, history = _stage2(config, closed_form, src, tgt, train, plan.val_pairs, fields, out, plan.val_memo)
    selection = {}
    if n_select:
        select = model_inputs(plan.train[len(plan.train) - n_select:])
        select_memo = ReferenceMemo()  # the selection conversations are scored once per checkpoint
        distilled, selection = best_checkpoint(distilled, closed_form, out / "checkpoints",
                                               lambda t: validation_kl(src, tgt, select, t, memo=select_memo))
    final = validation_kl(src, tgt, plan.val_pairs, distilled, memo=plan.val_memo)
    # Paired on the same conversations: per-conversation KL is heavy-tailed, so either mean's SE hides how sure
    # the gain is (the memo makes the closed form's second scoring one target pass per conversation).
    start = validation_kl(src, tgt, plan.val_pairs, closed_form, memo=plan.val_memo)
    gain, gain_se = paired_difference(final.per_sample, start.per_sample)
    quality = record_quality(src, tgt, plan.val_pairs, distilled)
    summary = {**summary}
    summary["quality"] = {**summary.get("quality", {}), "distilled": quality}
    summary["val_kl"] = {**summary["val_kl"], "distilled": final.mean}
    summary["val_kl_se"] = {**summary["val_kl_se"], "distilled": final.se}
    summary["first_token_kl"] = {**summary["first_token_kl"], "distilled": final.first_token}
    summary["selection"] = selection
    summary["stage2_gain"] = {"kl_difference": gain, "se": gain_se, "ratio": final.mean / start.mean}
    summary.update(stage="distilled", steps=config.steps, lr=config.lr, seed=config.seed, history=history,
                   artifact=str(out / "distilled"), run_dir=str(out), fingerprint=fingerprint(fields))
    summary["artifacts"] = {**summary["artifacts"], "distilled": str(out / "distilled")}
    save_translator(
        distilled,
        out / "distilled",
        **plan.signatures,
        fit={"stage": "distilled", "config": config.model_dump(mode="json"), "val_kl": summary["val_kl"], "steps": config.steps,
             "lr": config.lr, "selected_step": selection.get("step"), "fingerprint": fingerprint(fields),
             "data_manifest": plan.data_manifest,
             "quality": quality, **({"alignment": summary["alignment"]} if "alignment" in summary else {})},
    )
    return distilled, summary


# Fewer selection conversations than this choose nothing: stage 2 returns its last step. On a handful of
# conversations the choice follows their noise, and ties with the closed form would decide sweeps.
MIN_SELECTION = 8


def selection_size(config: FitConfig) -> int:
    """How many training conversations choose stage 2's checkpoint: n_select, at most a tenth of n_train, and
    none below MIN_SELECTION."""
    n = min(config.n_select, config.n_train // 10)
    return n if n >= MIN_SELECTION else 0


def best_checkpoint(last, closed_form, checkpoints: Path, score: Callable[[Any], Any]) -> tuple[Any, dict[str, Any]]:
    """The translator stage 2 returns among the closed form (step 0) and its saved checkpoints: the last step unless
    an earlier one is better on the selection conversations beyond their noise
    (`translators.checkpoint_selection.choose_checkpoint`).

    Args:
        last: the translator stage 2 ended with (a copy with the chosen checkpoint's maps is returned).
        score: a translator → its `ValidationKL` on the selection conversations (held out from stage 2, disjoint
            from validation; `per_sample` pairs the candidates).
    Returns:
        (translator, {"step": the chosen step, "kl": {step: mean KL}, "margin_se": the rule's margin}).
    """
    import copy

    from safetensors.torch import load_file

    from translators.checkpoint_selection import MARGIN_SE, choose_checkpoint

    def at(step: int):
        if step == 0:
            return copy.deepcopy(closed_form)
        translator = copy.deepcopy(last)
        for name, weight in load_file(str(checkpoints / f"step_{step:06d}" / "translator.safetensors")).items():
            translator.maps[name].data.copy_(weight)
        return translator

    steps = [0] + sorted(int(d.name.removeprefix("step_")) for d in checkpoints.glob("step_*"))
    scores = {step: score(at(step)) for step in steps}  # one candidate in memory at a time
    chosen = choose_checkpoint({step: kl.per_sample for step, kl in scores.items()})
    return at(chosen), {"step": chosen, "kl": {str(k): v.mean for k, v in scores.items()}, "margin_se": MARGIN_SE}


def distill_on_ray(plan: FitPlan, closed_form, summary: dict[str, Any], *, lr: float | None = None,
                   seed: int | None = None, cell_dir: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """`distill` on an idle Ray actor of the pair (tasks/cluster.py), stage 2 in that actor's process; several
    threads may call it at once (sweep cells run concurrently, one per actor). Checkpoints and artifacts go to
    `cell_dir` (a filesystem the actors share with this process). Returns what `distill` returns.

    Raises:
        ClusterError, NonFiniteError (a diverged cell), ConfigError.
    """
    from tasks.cluster import on_free_actor, workers_for

    config = plan.config
    actors = workers_for(config.source, config.target, workers=config.workers, address=config.ray_address,
                         signatures=plan.signatures, use_gpu=config.gpu)
    payload = {
        "config": config.model_copy(update={"workers": 1, "gpu": False, "ray_address": None}),
        "train": plan.train, "val": plan.val, "candidates": plan.candidates, "nu": plan.nu, "out": str(plan.out),
        "signatures": plan.signatures, "data_manifest": plan.data_manifest, "fingerprint_fields": plan.fingerprint_fields,
        "closed_form": closed_form, "summary": summary, "lr": lr, "seed": seed,
        "cell_dir": str(cell_dir) if cell_dir else None,
    }
    return on_free_actor(actors, "call", _distill_in_actor, payload)


def _distill_in_actor(source, target, payload: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Runs in a Ray actor holding the pair: the plan rebuilt around the actor's models, then `distill`."""
    plan = FitPlan(payload["config"], source, target, payload["train"], payload["val"], payload["candidates"],
                   payload["nu"], Path(payload["out"]), payload["signatures"], payload["data_manifest"], payload["fingerprint_fields"])
    return distill(plan, payload["closed_form"], payload["summary"], lr=payload["lr"], seed=payload["seed"],
                   cell_dir=Path(payload["cell_dir"]) if payload["cell_dir"] else None)


def distill_seeds(plan: FitPlan, closed_form, summary: dict[str, Any]) -> dict[str, Any]:
    """Stage 2 once per seed of `config.seeds` (default: `config.seed` alone), all from the same closed form.

    With several seeds each runs in `seeds/seed_<k>/`; the summary's val_kl.distilled is the seed mean, with
    `val_kl_seed_sd` (sample SD over seeds, App. E.1) beside the item SE, and `by_seed` holds each seed's result.
    The first seed's artifact is the run's distilled translator.
    """
    import statistics

    seeds = plan.config.seeds or [plan.config.seed]
    if len(seeds) == 1:
        return distill(plan, closed_form, summary, seed=seeds[0])[1]
    results = [distill(plan, closed_form, summary, seed=seed, cell_dir=plan.out / "seeds" / f"seed_{seed}")[1]
               for seed in seeds]
    kls = [r["val_kl"]["distilled"] for r in results]
    merged = {**results[0], "run_dir": str(plan.out), "seeds": seeds, "fingerprint": plan.fingerprint}
    merged["val_kl"] = {**results[0]["val_kl"], "distilled": statistics.fmean(kls)}
    merged["val_kl_seed_sd"] = {"distilled": statistics.stdev(kls)}
    merged["by_seed"] = {str(seed): {"val_kl": r["val_kl"]["distilled"], "val_kl_se": r["val_kl_se"]["distilled"],
                                     "stage2_gain": r["stage2_gain"], "artifact": r["artifact"],
                                     "fingerprint": r["fingerprint"]}
                         for seed, r in zip(seeds, results)}
    del merged["stage2_gain"]  # one seed's paired gain beside the seed mean would read as the mean's
    return merged


def _stage2(config: FitConfig, closed_form, src, tgt, train, val_pairs, run_signature: dict[str, Any], out: Path,
            val_memo: ReferenceMemo):
    """Distil from a copy of the closed-form maps (which stay saved as the stage-1 baseline). `val_memo` serves
    the in-process run's validations (Ray Train's rank 0 keeps its own)."""
    import copy

    from tasks.distill import run_ray, run_single
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
    train_pairs = model_inputs(train)
    translator = copy.deepcopy(closed_form)
    checkpoints = out / "checkpoints"
    if not config.resume:
        shutil.rmtree(checkpoints, ignore_errors=True)
    from tasks.cluster import release_workers

    release_workers()  # stage 1's (or an evaluation's) Ray actors would hold the CPUs Ray Train's workers need
    if config.workers == 1:
        with progress_bars() as progress:
            task = progress.add_task("stage 2: distillation", total=config.steps)
            return run_single(translator, src, tgt, train_pairs, val_pairs, settings, run_signature, checkpoints,
                              report=lambda record: progress.update(task, completed=record["step"]), memo=val_memo)
    return run_ray(translator, config.source, config.target, train_pairs, val_pairs, settings, run_signature,
                   checkpoints, workers=config.workers, use_gpu=config.gpu, ray_address=config.ray_address)
