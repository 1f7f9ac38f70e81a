"""Stage 2 drivers: one step implementation (translators.train.Trainer), two ways to run it.

- `run_single`: one process, for notebooks and tests.
- `run_ray`: Ray Train `TorchTrainer` with W workers (gloo on CPU, nccl on GPU clusters); each worker loads
  the frozen pair itself, takes its share of every step's conversations, and gradients are summed across
  workers with `torch.distributed.all_reduce` before the update, so the trajectory equals one process with
  the same effective batch. Metrics go through `ray.train.report`; checkpoints are kvlingo's own
  (safetensors + JSON in the run directory), so both drivers resume from each other's checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from translators.distill import Objective
from translators.stage1 import ReferenceMemo
from translators.train import Sample, TrainSettings, Trainer
from translators.translator import Translator


def run_single(
    translator: Translator,
    source,
    target,
    train: Sequence[Sample],
    val: Sequence[Sample],
    settings: TrainSettings,
    run_signature: dict[str, Any],
    checkpoint_dir: Path | None,
    report: Callable[[dict[str, Any]], None] | None = None,
    memo: ReferenceMemo | None = None,
) -> tuple[Translator, list[dict[str, Any]]]:
    """Train in this process. `source`/`target` are `translators.stage1.Side`s; `memo` keeps the validation
    conversations' references for the caller's later scores (the trainer's own otherwise)."""
    trainer = Trainer(translator, source, target, train, val, settings, run_signature, checkpoint_dir, report=report,
                      memo=memo)
    return translator, trainer.run()


def _translator_payload(translator: Translator) -> dict[str, Any]:
    return {
        "assignment": translator.assignment,
        "d_src": translator.d_src,
        "d_tgt": translator.d_tgt,
        "point": translator.point,
        "inputs": translator.inputs,
        "token_identity": translator.token_identity,
        "maps": {name: p.detach().clone() for name, p in translator.maps.items()},
    }


def _translator_from_payload(payload: dict[str, Any]) -> Translator:
    translator = Translator(payload["assignment"], payload["d_src"], payload["d_tgt"], payload["point"],
                            payload["inputs"], payload["token_identity"])
    for name, value in payload["maps"].items():
        translator.maps[name].data.copy_(value)
    return translator


def _ray_worker(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import torch.distributed as dist

    from infra.zoo import load_model
    from translators.stage1 import Side
    from translators.token_identity import attach_token_identity

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(config["threads_per_worker"])
    source, target = load_model(config["source"]), load_model(config["target"])
    # The token-identity module (embedding, codebook) is rebuilt from the models, not shipped in the payload.
    translator = attach_token_identity(_translator_from_payload(config["translator"]), source.model, source.layout,
                                       target.model)
    settings = TrainSettings(**{**config["settings"], "objective": Objective(**config["settings"]["objective"])})

    def reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def report(record: dict[str, Any]) -> None:
        ray.train.report({**record, "rank": rank})

    trainer = Trainer(
        translator,
        Side(source.model, source.layout),
        Side(target.model, target.layout),
        config["train"],
        config["val"],
        settings,
        config["run_signature"],
        Path(config["checkpoint_dir"]) if config["checkpoint_dir"] else None,
        rank=rank,
        world=world,
        reduce=reduce,
        report=report,
    )
    trainer.run(stop_after=config.get("stop_after"))
    if rank == 0 and config["result_dir"]:
        from safetensors.torch import save_file

        Path(config["result_dir"]).mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in translator.maps.items()}, str(Path(config["result_dir"]) / "maps.safetensors"))
        (Path(config["result_dir"]) / "history.json").write_text(__import__("json").dumps(trainer.history))


def ray_init(address: str | None = None) -> None:
    """Start (or join) Ray quietly and offline: no dashboard, no usage stats, a short temp dir for sockets."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    temp_dir = Path(tempfile.gettempdir()) / f"kvlingo-ray-{os.getuid()}"
    ray.init(include_dashboard=False, _temp_dir=str(temp_dir), num_cpus=os.cpu_count(), log_to_driver=False,
             configure_logging=False)


def run_ray(
    translator: Translator,
    source_name: str,
    target_name: str,
    train: Sequence[Sample],
    val: Sequence[Sample],
    settings: TrainSettings,
    run_signature: dict[str, Any],
    checkpoint_dir: Path | None,
    *,
    workers: int = 2,
    use_gpu: bool = False,
    ray_address: str | None = None,
    stop_after: int | None = None,
    threads_per_worker: int | None = None,
) -> tuple[Translator, list[dict[str, Any]]]:
    """Train with Ray Train; returns the trained translator (rank 0's maps) and its history.

    `threads_per_worker` sets torch's CPU threads in each worker (default: this machine's cores over the
    workers); a matrix product's rounding can depend on the thread count, so a bit-exact comparison with
    `run_single` pins the same count in both.
    """
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from safetensors.torch import load_file

    from infra.settings import kvlingo_home

    ray_init(ray_address)
    # Rank 0 leaves the trained maps and history here; removed once they are read back.
    with tempfile.TemporaryDirectory(prefix="kvlingo-distill-") as scratch:
        result_dir = Path(scratch)
        settings_dict = {**asdict(settings), "objective": asdict(settings.objective)}
        config = {
            "source": source_name,
            "target": target_name,
            "translator": _translator_payload(translator),
            "settings": settings_dict,
            "train": [tuple(s) for s in train],
            "val": [tuple(s) for s in val],
            "run_signature": run_signature,
            "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None,
            "result_dir": str(result_dir),
            "threads_per_worker": threads_per_worker or max(1, (os.cpu_count() or 1) // workers),
            "stop_after": stop_after,
        }
        trainer = TorchTrainer(
            _ray_worker,
            train_loop_config=config,
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
            run_config=RunConfig(name="kvlingo-distill", storage_path=str(kvlingo_home() / "ray_results")),
        )
        trainer.fit()
        maps = load_file(str(result_dir / "maps.safetensors"))
        for name, value in maps.items():
            translator.maps[name].data.copy_(value)
        history = json.loads((result_dir / "history.json").read_text())
        return translator, history
