"""Stage 2 training: one step implementation shared by the single-process loop and the Ray Train workers.

Recipe (App. E): AdamW, cosine schedule with 5% warmup, no weight decay, gradient clipping at 1.0, one
conversation at a time (no padding), gradient accumulation to the effective batch, closed-form maps as the
initialisation. The data order is a pure function of (seed, step), and each of W workers takes a contiguous
share of a step's conversations, so W workers × accumulation B/W follow the same trajectory as one process
× accumulation B (gradients are summed across workers before the update).

Checkpoints are safetensors + JSON (no pickle): translator maps, AdamW moments, step and schedule, plus the
run's config and pair signatures; resuming under another signature is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from translators.capture import Capture, capture
from translators.cross import CrossSample, cross_sample_loss, teacher_hidden_cross, validation_kl_for
from translators.distill import Objective, sample_loss, teacher_hidden
from translators.errors import ConfigError, NonFiniteError, PairMismatchError
from translators.stage1 import ReferenceMemo, Side
from translators.translator import Translator

# Memory for the references one trainer keeps across epochs (Trainer._references: the source's captures and the
# target's hidden states): 600 embedded conversations take about 0.3 GB; a large pair's long prefixes run past it
# and are recomputed at each visit.
CAPTURE_CACHE_BYTES = 2 << 30

# (prefix_ids [n], continuation_ids [m]) of a same-tokenizer pair, or a cross-tokenizer sample (App. K).
Sample = tuple[torch.Tensor, torch.Tensor] | CrossSample


@dataclass(frozen=True)
class TrainSettings:
    lr: float
    steps: int
    batch: int = 8  # effective batch: conversations per optimizer step, over all workers
    warmup_frac: float = 0.05
    clip: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    seed: int = 0
    objective: Objective = field(default_factory=Objective)

    def __post_init__(self):
        problems = []
        if not self.lr > 0 or not math.isfinite(self.lr):
            problems.append(f"learning rate must be > 0, got {self.lr}")
        if self.steps < 1:
            problems.append(f"steps must be ≥ 1, got {self.steps}")
        if self.batch < 1:
            problems.append(f"batch must be ≥ 1, got {self.batch}")
        if self.eval_every < 1 or self.checkpoint_every < 1:
            problems.append("eval_every and checkpoint_every must be ≥ 1")
        if problems:
            raise ConfigError("; ".join(problems))

    def signature(self) -> dict[str, Any]:
        return {**asdict(self), "objective": asdict(self.objective)}


def step_indices(step: int, batch: int, n_samples: int, seed: int) -> list[int]:
    """The conversations of optimizer step `step`: a seeded permutation per epoch, read `batch` at a time."""
    out = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, n_samples)
        out.append(epoch_order(seed, epoch, n_samples)[offset])
    return out


@functools.lru_cache(maxsize=4)  # a step reads one epoch's order, two at an epoch boundary
def epoch_order(seed: int, epoch: int, n_samples: int) -> tuple[int, ...]:
    """The seeded permutation of `range(n_samples)` for `epoch`: shuffled once, not once per position read."""
    order = list(range(n_samples))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)


def worker_share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s contiguous share of a step's conversations.

    Raises:
        ConfigError: the batch does not divide evenly over the workers.
    """
    if len(indices) % world:
        raise ConfigError(f"the effective batch ({len(indices)}) must be divisible by the number of workers ({world})")
    k = len(indices) // world
    return list(indices[rank * k : (rank + 1) * k])


def cosine_with_warmup(step: int, total: int, warmup_frac: float) -> float:
    """LR multiplier: linear warmup over the first ⌈warmup_frac·total⌉ steps, then cosine decay to 0."""
    warmup = max(1, math.ceil(warmup_frac * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def signature_hash(signature: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Trainer:
    """Holds the state of one stage-2 run on one worker (rank) of `world`."""

    translator: Translator
    source: Side
    target: Side
    train: Sequence[Sample]
    val: Sequence[Sample]
    settings: TrainSettings
    run_signature: dict[str, Any]  # pair + config; checkpoints carry it and resuming checks it
    checkpoint_dir: Path | None = None
    rank: int = 0
    world: int = 1
    reduce: Callable[[torch.Tensor], None] | None = None  # in-place sum across workers (None: single process)
    report: Callable[[dict[str, Any]], None] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    memo: ReferenceMemo | None = None  # the validation references (see ReferenceMemo); None: one of its own

    def __post_init__(self):
        if not self.train:
            raise ConfigError("empty training set: stage 2 needs at least one conversation")
        if not self.val:
            raise ConfigError("empty validation set: hold out at least one conversation for stage 2")
        for sample in list(self.train) + list(self.val):
            continuation = sample.continuation_ids if isinstance(sample, CrossSample) else sample[1]
            if continuation.numel() < 1:
                raise ConfigError("zero-length continuation in the stage-2 data: every sample needs ≥ 1 continuation token")
        self.params = list(self.translator.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=self.settings.lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_with_warmup(s, self.settings.steps, self.settings.warmup_frac)
        )
        if self.memo is None:
            self.memo = ReferenceMemo()
        # The frozen models' references of each training sample (the target's hidden states, the source's capture):
        # every epoch reads the same samples, so kept ones are bit-identical to recomputed ones.
        self._references = ReferenceMemo(budget_bytes=CAPTURE_CACHE_BYTES)
        self.step_done = 0

    # -- one optimizer step -------------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Accumulate this worker's share of step `step`, sum over workers, clip, update. Returns the mean loss.

        Raises:
            NonFiniteError: the loss or the gradient is NaN/Inf (no update is applied).
        """
        indices = step_indices(step, self.settings.batch, len(self.train), self.settings.seed)
        # Per-sample gradients are summed in fp64 and rounded to fp32 once, after the cross-worker sum. Summing
        # fp32 gradients in fp32 makes the result depend on the order of the additions, which differs between
        # one process (g1+…+gB in turn) and W workers (per-share sums, then the all-reduce); in fp64 the
        # rounding error is ~1e-16 relative, far below fp32's ulp, so both orders round to the same fp32
        # gradient and the trajectories agree bit for bit (tests/integration/test_ray_distill.py).
        grad_sums = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]  # same shapes as the maps
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i in worker_share(indices, self.rank, self.world):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._sample_loss(i) / self.settings.batch
            loss.backward()
            for total, p in zip(grad_sums, self.params):
                if p.grad is not None:  # a map whose target layer this sample never reads
                    total += p.grad
            loss_sum += loss.detach().double()
        if self.reduce is not None:
            for total in grad_sums:
                self.reduce(total)
            self.reduce(loss_sum)
        for total, p in zip(grad_sums, self.params):
            p.grad = total.to(p.dtype)
        loss_value = float(loss_sum)
        if not math.isfinite(loss_value):
            raise NonFiniteError(
                f"stage 2 loss is {loss_value} at step {step}: stopped; the last good checkpoint is kept"
                + (f" in {self.checkpoint_dir}" if self.checkpoint_dir else "")
                + ". Lower the learning rate."
            )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.clip)
        if not torch.isfinite(grad_norm):
            raise NonFiniteError(f"non-finite gradient norm at step {step}: stopped; lower the learning rate")
        self.optimizer.step()
        self.scheduler.step()
        self.step_done = step + 1
        return loss_value

    def _sample_loss(self, i: int) -> torch.Tensor:
        if isinstance(self.train[i], CrossSample):
            return self._cross_sample_loss(i)
        prefix, continuation = self.train[i]
        teacher = self._references.get("teacher_hidden", self.train[i],
                                       lambda: teacher_hidden(self.target.model, prefix, continuation))
        src = self._source_capture(i, prefix)
        return sample_loss(
            self.translator, src, self.target.model, self.target.layout, prefix, continuation,
            self.settings.objective, teacher=teacher,
        )

    def _cross_sample_loss(self, i: int) -> torch.Tensor:
        """The same loss over a cross-tokenizer sample: the source captures its own rendering, the target reads
        translated content between its own prefilled boilerplate (`translators.cross`)."""
        sample = self.train[i]
        teacher = self._references.get("teacher_hidden", sample, lambda: teacher_hidden_cross(self.target.model, sample))
        src = self._source_capture(i, sample.source_ids, whole=True)
        return cross_sample_loss(self.translator, src, self.target, sample, self.settings.objective, teacher=teacher)

    def _source_capture(self, i: int, prefix: torch.Tensor, *, whole: bool = False) -> Capture:
        """The frozen source's capture of prefix[:-1] (of the whole rendering for a cross-tokenizer sample), kept
        while the trainer's references stay under CAPTURE_CACHE_BYTES: on the embedded pair the source's forward
        is about 45% of a step. Samples past the budget (large pairs, long prefixes) are captured at each visit."""
        point = self.translator.point

        def source_forward() -> Capture:
            with torch.no_grad():
                return capture(self.source.model, self.source.layout, prefix if whole else prefix[:-1], point)

        return self._references.get(f"capture:{point}", self.train[i], source_forward)

    # -- the loop -----------------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        result = validation_kl_for(self.source, self.target, self.val, self.translator, memo=self.memo)
        return {"val_kl": result.mean, "val_kl_se": result.se, "val_first_token_kl": result.first_token}

    def run(self, *, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train from the latest checkpoint (if any) to `settings.steps` (or stop early after `stop_after`
        steps, used to simulate an interruption). Rank 0 validates and checkpoints."""
        self.resume()
        last = self.settings.steps if stop_after is None else min(self.settings.steps, stop_after)
        for step in range(self.step_done, last):
            loss = self.train_step(step)
            record: dict[str, Any] = {"step": step + 1, "train_kl": loss, "lr": self.scheduler.get_last_lr()[0]}
            done = step + 1 == self.settings.steps
            if self.rank == 0 and ((step + 1) % self.settings.eval_every == 0 or done):
                record.update(self.validate())
            self.history.append(record)
            if self.rank == 0 and ((step + 1) % self.settings.checkpoint_every == 0 or done):
                self.save_checkpoint()
            if self.report:
                self.report(record)
        return self.history

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write `step_NNNNNN/` atomically under checkpoint_dir; keeps older ones (the last good one survives)."""
        if self.checkpoint_dir is None:
            return None
        final = Path(self.checkpoint_dir) / f"step_{self.step_done:06d}"
        tmp = Path(self.checkpoint_dir) / f".tmp_step_{self.step_done:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        names = dict(self.translator.maps.items())
        save_file({n: p.detach().contiguous() for n, p in names.items()}, str(tmp / "translator.safetensors"))
        moments, steps = {}, {}
        for n, p in names.items():
            state = self.optimizer.state.get(p, {})
            if state:
                moments[f"{n}.exp_avg"] = state["exp_avg"].contiguous()
                moments[f"{n}.exp_avg_sq"] = state["exp_avg_sq"].contiguous()
                steps[n] = float(state["step"])
        if moments:
            save_file(moments, str(tmp / "optimizer.safetensors"))
        meta = {
            "step": self.step_done,
            "scheduler_last_epoch": self.scheduler.last_epoch,
            "adam_steps": steps,
            "run_signature_sha256": signature_hash(self.run_signature),
            "run_signature": self.run_signature,
            "history": self.history,
        }
        (tmp / "state.json").write_text(json.dumps(meta, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def latest_checkpoint(self) -> Path | None:
        if self.checkpoint_dir is None or not Path(self.checkpoint_dir).is_dir():
            return None
        found = sorted(p for p in Path(self.checkpoint_dir).glob("step_*") if (p / "state.json").is_file())
        return found[-1] if found else None

    def resume(self) -> None:
        """Restore the latest checkpoint, if any.

        Raises:
            PairMismatchError: the checkpoint was written for another pair or configuration.
        """
        path = self.latest_checkpoint()
        if path is None:
            return
        meta = json.loads((path / "state.json").read_text())
        if meta["run_signature_sha256"] != signature_hash(self.run_signature):
            raise PairMismatchError(
                f"the checkpoint in {path} belongs to another run: {_describe_changes(meta['run_signature'], self.run_signature)}. "
                "Use another output directory, or the same pair and config to resume."
            )
        maps = load_file(str(path / "translator.safetensors"))
        for n, p in self.translator.maps.items():
            p.data.copy_(maps[n])
        if (path / "optimizer.safetensors").is_file():
            moments = load_file(str(path / "optimizer.safetensors"))
            for n, p in self.translator.maps.items():
                if n in meta["adam_steps"]:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(meta["adam_steps"][n]),
                        "exp_avg": moments[f"{n}.exp_avg"].clone(),
                        "exp_avg_sq": moments[f"{n}.exp_avg_sq"].clone(),
                    }
        # Replay the schedule (cheap, and uses only the scheduler's public API).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
            for _ in range(meta["scheduler_last_epoch"] - self.scheduler.last_epoch):
                self.scheduler.step()
        self.step_done = meta["step"]
        self.history = list(meta["history"])


def _changes(old: Any, new: Any, path: str = "signature") -> list[str]:
    """Every leaf that differs between two run signatures, as `path was X and is now Y`."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for key in sorted(set(old) | set(new), key=str) if old.get(key) != new.get(key)
                for change in _changes(old.get(key), new.get(key), f"{path}.{key}")]
    return [f"{path} was {json.dumps(old, default=str)[:60]} and is now {json.dumps(new, default=str)[:60]}"]


def _describe_changes(old: Any, new: Any, limit: int = 8) -> str:
    changes = _changes(old, new)
    return "; ".join(changes[:limit]) + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")
