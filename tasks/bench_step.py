"""`kvlingo bench step`: one stage-2 distillation step beside one plain forward+backward of the target on the
same tokens, measured side by side in one process (medians over repeats), printed as ratios.

The distillation step = source capture of x_{1:n-1} (no grad) + teacher prefill (no grad; cached across epochs
in training, so reported separately) + translate + inject + target forward on x_n y_{1:m-1} + chunked KL +
backward into the maps + AdamW update. The baseline = the target's forward over x_{1:n} y_{1:m-1} with its
weights trainable, cross-entropy on y, backward (what fine-tuning the target on the same tokens costs).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch


def run_step_bench(source_name: str, target_name: str, *, prefix_tokens: int = 512, continuation_tokens: int = 64,
                   repeats: int = 3, translator_ref: str | None = None) -> dict[str, Any]:
    """Returns medians (seconds, peak MB above the start of each block) and the ratios step / baseline.

    Args:
        translator_ref: a `registry.translator_ref` reference (PATH, models:/NAME@ALIAS, identity: dense trainable
            identity maps); default: random relative-depth ν=1 maps (the cost does not depend on the values).
    Raises:
        ConfigError: repeats < 1 or lengths < 1, a malformed translator reference.
        PrefixTooLongError: beyond a model's positions. PairMismatchError: a translator fitted for other models.
    """
    from evals.memory import MEASURE, peak_memory
    from infra.pairs import check_same_tokenizer
    from infra.prompts import prompt_of_length
    from infra.zoo import load_model
    from registry.translator_ref import load_translator_ref, parse_translator_ref
    from translators.capture import capture, check_length
    from translators.distill import Objective, sample_loss, teacher_hidden
    from translators.errors import ConfigError
    from translators.switch import identity_translator
    from translators.stage1 import zero_translator

    if repeats < 1 or prefix_tokens < 2 or continuation_tokens < 1:
        raise ConfigError("repeats ≥ 1, prefix ≥ 2 and continuation ≥ 1 tokens are required")
    ref = parse_translator_ref(translator_ref) if translator_ref is not None else None
    source, target = load_model(source_name), load_model(target_name)
    check_same_tokenizer(source, target)
    for loaded in (source, target):
        check_length(loaded.layout, prefix_tokens + continuation_tokens, "bench sequence")
    ids = prompt_of_length(target.tokenizer, prefix_tokens + continuation_tokens)
    prefix, continuation = ids[:prefix_tokens], ids[prefix_tokens:]
    if ref is not None:
        # The identity has no maps to train: time dense identity maps, which cost what a ν=1 map costs.
        translator = load_translator_ref(ref, source, target)
        translator = identity_translator(target.layout).to(target.model.device) if translator is None else translator
    else:  # relative-depth ν=1 maps of the right shapes: the cost does not depend on the values
        from translators.assignment import relative_depth

        band = relative_depth(source.layout.n_layers, target.layout.n_layers, 1, source.layout.attention_types,
                              target.layout.attention_types)
        translator = zero_translator(source.layout, target.layout, band, "pre_norm")
        torch.nn.init.normal_(next(iter(translator.maps.values())), std=0.01)
    optimizer = torch.optim.AdamW(translator.parameters(), lr=1e-4, weight_decay=0.0)
    objective = Objective("kl", chunk=128)
    device = target.model.device

    def distill_step() -> None:
        with torch.no_grad():
            src = capture(source.model, source.layout, prefix[:-1], translator.point)
        loss = sample_loss(translator, src, target.model, target.layout, prefix, continuation, objective, teacher=teacher)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    trainable = copy.deepcopy(target.model).requires_grad_(True).train(False)
    full = torch.cat([prefix, continuation[:-1]]).view(1, -1).to(device)

    def baseline_step() -> None:
        logits = trainable(input_ids=full, use_cache=False, logits_to_keep=continuation.numel()).logits[0]
        torch.nn.functional.cross_entropy(logits.float(), continuation.to(device)).backward()
        trainable.zero_grad(set_to_none=True)

    def teacher_step() -> None:
        teacher_hidden(target.model, prefix, continuation)

    teacher = teacher_hidden(target.model, prefix, continuation)
    timings: dict[str, list[float]] = {"distill_step": [], "teacher_prefill": [], "target_fwd_bwd": []}
    peaks: dict[str, list[float]] = {k: [] for k in timings}
    runs = {"distill_step": distill_step, "teacher_prefill": teacher_step, "target_fwd_bwd": baseline_step}
    for name, fn in runs.items():
        fn()  # warm-up: first calls allocate caches and pick kernels
    for _ in range(repeats):
        for name, fn in runs.items():  # interleaved, so machine noise hits every path alike
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timings[name].append(time.perf_counter() - start)
    for name, fn in runs.items():  # memory in a separate pass: the CPU probe slows the timed path
        with peak_memory(device) as peak:
            fn()
        peaks[name].append(peak.mb)
    med = {k: statistics.median(v) for k, v in timings.items()}
    mem = {k: (statistics.median(v) if v else None) for k, v in peaks.items()}
    base_mem = mem["target_fwd_bwd"]
    return {
        "source": source.name, "target": target.name, "prefix_tokens": prefix_tokens,
        "continuation_tokens": continuation_tokens, "repeats": repeats, "device": str(device),
        "seconds": med, "peak_mb": mem, "memory_measure": MEASURE,
        "time_ratio": med["distill_step"] / med["target_fwd_bwd"],
        "time_ratio_with_teacher": (med["distill_step"] + med["teacher_prefill"]) / med["target_fwd_bwd"],
        "memory_ratio": (mem["distill_step"] / base_mem) if mem["distill_step"] is not None and base_mem else None,
        "translator_parameters": sum(p.numel() for p in translator.parameters()),
    }
