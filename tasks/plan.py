"""`kvlingo plan`: the cost model (tasks/cost_model.py) fed from config.json files, and a measurement of stage 1
on this machine beside its prediction.

Config look-up never loads weights: a zoo model's built directory (the embedded pair, a converted GGUF), a local
directory holding config.json, a hub id in `--configs DIR` (DIR/org/name/, DIR/name/ or DIR/org--name/), or in the
local Hugging Face cache (offline), downloading config.json only when the user turned offline mode off.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tasks.cost_model import ModelShape, Throughput, Workload, capture_flops_per_token, candidate_sets, estimate, fit_nu, gram_flops_per_token
from translators.errors import ConfigError


class ConfigUnavailableError(ConfigError):
    """No config.json for a model can be found here (offline, not cached, not in --configs)."""


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigUnavailableError(f"cannot read {path}: {err}") from None


def config_for(name: str, configs_dir: Path | None = None) -> dict[str, Any]:
    """The config.json mapping of `name` (zoo name, local directory, hub id), without loading weights.

    Raises:
        UnknownModelError: not a zoo name, directory or hub id ("did you mean").
        ConfigUnavailableError: a hub id whose config.json is neither in `configs_dir` nor in the local HF cache
            while offline (names the places searched and how to provide it).
    """
    from infra.settings import kvlingo_home
    from infra.zoo import resolve_model

    if configs_dir is not None:
        org, _, base = name.rpartition("/")
        for candidate in (configs_dir / name, configs_dir / base, configs_dir / f"{org}--{base}"):
            if (candidate / "config.json").is_file():
                return _read(candidate / "config.json")
    spec = resolve_model(name)
    if spec.source == "local":
        return _read(Path(spec.location) / "config.json")
    if spec.source == "embedded":
        built = kvlingo_home() / "models" / spec.location / "config.json"
        if built.is_file():
            return _read(built)
        from infra.tiny_models import ensure_tiny_model  # builds the embedded model on first use (minutes)

        return _read(ensure_tiny_model(spec.location) / "config.json")
    if spec.source == "gguf_package":
        found = sorted((kvlingo_home() / "models").glob(f"{spec.name}-*/config.json"))
        if found:
            return _read(found[-1])
        from infra.zoo import _materialise  # dequantises the GGUF once (~20 s)

        return _read(Path(_materialise(spec)[0]) / "config.json")
    return _read(_hub_config(spec.location, configs_dir))


def _hub_config(repo: str, configs_dir: Path | None) -> Path:
    from huggingface_hub import hf_hub_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(hf_hub_download(repo, "config.json", local_files_only=offline))
    except Exception as err:  # not cached offline, or a network/auth error online
        where = f"{configs_dir}/{repo}/config.json, " if configs_dir else ""
        raise ConfigUnavailableError(
            f"no config.json for {repo}: looked in {where}the local Hugging Face cache"
            + (" (offline: HF_HUB_OFFLINE=1)" if offline else f" and the hub ({type(err).__name__})")
            + f". Put its config.json in a folder and pass --configs FOLDER (as FOLDER/{repo}/config.json), pass a "
            "local model directory instead of the hub id, or export HF_HUB_OFFLINE=0 to download it.") from None


def shape_for(name: str, configs_dir: Path | None = None) -> ModelShape:
    """The cost model's view of `name` (see `config_for`)."""
    return ModelShape.from_config(name, config_for(name, configs_dir))


def plan(source: str, target: str, workload: Workload, gpus: int, throughput: Throughput | None = None,
         configs_dir: Path | None = None) -> dict[str, Any]:
    """The cost estimate of `source` → `target` as a JSON-ready dict (`CostEstimate.as_dict`).

    Raises:
        ConfigError (all problems at once for the names), ConfigUnavailableError, UnsupportedConfigError.
    """
    problems, shapes = [], {}
    for role, name in (("source", source), ("target", target)):
        try:
            shapes[role] = shape_for(name, configs_dir)
        except ConfigError as err:
            problems.append(f"{role}: {err}")
    if problems:
        raise ConfigError("cannot plan:\n  " + "\n  ".join(problems))
    return estimate(shapes["source"], shapes["target"], workload, gpus, throughput).as_dict()


# -- predicted vs measured on this machine ---------------------------------------------------------------------
def _matmul_rate(dtype, size: int = 512, repeats: int = 5) -> float:
    """Sustained FLOP/s of a square matmul in `dtype` on this CPU (best of `repeats`)."""
    import torch

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def measure_stage1(source: str, target: str, *, prefix_tokens: int = 256, samples: int = 4,
                   assignment: str = "r2", nu: int | None = None, point: str = "pre_norm", seed: int = 0) -> dict[str, Any]:
    """Time stage 1 per token on this CPU for a pair that runs here, beside the cost model's prediction.

    The prediction divides the model's FLOPs by this CPU's measured matmul rate (fp32 for the capture forwards,
    fp64 for the Gram products), i.e. it assumes the rate of a large square matmul; the ratio measured/predicted
    is the efficiency the cost model's `mfu` / `gram_efficiency` stand for. Token ids are random (cost does not
    depend on content). Returns seconds per token (capture per model, Gram) and the ratios.

    Raises:
        UnknownModelError, ModelUnavailableError, ConfigError (assignment, ν).
    """
    import torch

    from infra.zoo import load_model
    from translators.capture import capture
    from translators.objects import object_inputs
    from translators.stage1 import empty_stats
    from translators.translator import source_features

    src, tgt = load_model(source, device="cpu"), load_model(target, device="cpu")
    shapes = {"source": ModelShape.from_config(src.name, src.model.config.to_dict()),
              "target": ModelShape.from_config(tgt.name, tgt.model.config.to_dict())}
    cands = candidate_sets(shapes["source"], shapes["target"], assignment, fit_nu(shapes["source"], shapes["target"], nu))
    stats = empty_stats(src.layout, tgt.layout, cands)
    inputs = object_inputs(src.layout, tgt.layout)
    gen = torch.Generator().manual_seed(seed)
    vocab = min(shapes["source"].vocab, shapes["target"].vocab)
    ids = [torch.randint(0, vocab, (prefix_tokens,), generator=gen) for _ in range(samples + 1)]
    times = {"source": 0.0, "target": 0.0, "gram": 0.0}
    with torch.no_grad():
        for i, x in enumerate(ids):  # the first sample warms up and is not timed
            t0 = time.perf_counter()
            cs = capture(src.model, src.layout, x, point)
            t1 = time.perf_counter()
            ct = capture(tgt.model, tgt.layout, x, point)
            t2 = time.perf_counter()
            for name, object_stats in stats.items():
                features = [source_features(cs.objects, inputs[name], s) for s in range(src.layout.n_layers)]
                object_stats.accumulate(features, ct.objects[name])
            t3 = time.perf_counter()
            if i:
                times["source"] += t1 - t0
                times["target"] += t2 - t1
                times["gram"] += t3 - t2
    tokens = samples * prefix_tokens
    measured = {k: v / tokens for k, v in times.items()}
    fp32, fp64 = _matmul_rate(torch.float32), _matmul_rate(torch.float64)
    predicted = {
        "source": capture_flops_per_token(shapes["source"], prefix_tokens) / fp32,
        "target": capture_flops_per_token(shapes["target"], prefix_tokens) / fp32,
        "gram": gram_flops_per_token(shapes["source"], shapes["target"], cands) / fp64,
    }
    measured["total"], predicted["total"] = sum(measured.values()), sum(predicted.values())
    return {
        "source": src.name, "target": tgt.name, "prefix_tokens": prefix_tokens, "samples": samples,
        "threads": torch.get_num_threads(), "matmul_gflops": {"fp32": fp32 / 1e9, "fp64": fp64 / 1e9},
        "seconds_per_token": {"measured": measured, "predicted": predicted},
        "measured_over_predicted": {k: measured[k] / predicted[k] for k in measured},
    }
