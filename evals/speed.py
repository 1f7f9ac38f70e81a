"""Timing harness for the switch (paper §4.8, App. Y): time to first token after a switch vs re-prefill,
peak memory of both paths, decoding speed after each, and the FLOP model beside the measured ratio.

Both paths run through the runtime's own pieces (`translated_cache`, `decode_step`, `decode_from`) in the same
process with the same torch threads. The source's capture of x_{1:n-1} is taken once, untimed: in deployment
the source already holds its cache.

Memory: `evals.memory.peak_memory` (peak torch allocations above the start of the path, on CPU and CUDA alike),
measured in one extra untimed run of each path, since the CPU probe slows the code it watches.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from transformers import DynamicCache

from evals.memory import peak_memory
from translators.capture import capture
from translators.errors import ConfigError
from translators.generation import GenerationSettings, decode_from, sync
from translators.inject import decode_step
from translators.layout import GLOBAL, CacheLayout
from translators.stage1 import Side
from translators.switch import translated_cache
from translators.translator import Translator

# --- FLOP model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP model needs from the target.

    Formulas (multiply-add = 2 FLOPs, batch 1):
    - prefill(n) = 2·P·n + 4·d_q·Σ_layers Σ_{i=1..n} ctx_l(i) + 2·d·V, where P = non-embedding parameters,
      d_q = query width (heads·head_dim, = d_model for most models), ctx_l(i) = i for global layers and
      min(i, window) for sliding ones (so a global model's attention term is ≈ 4·n²·d_q·n_layers/2), and one
      row of output logits (logits_to_keep=1).
    - step(n) = 2·P + 4·d_q·Σ_layers ctx_l(n) + 2·d·V: one decoding step over a cache of n-1 tokens.
    - map(n) = translator.flops_per_token()·(n-1) = Σ_layers 4·ν·d_src·d_tgt per token (K and V maps).
    flop_ratio = prefill(n) / (map(n) + step(n)).
    """

    non_embedding_params: int
    query_width: int
    hidden: int
    vocab: int
    windows: tuple[int | None, ...]  # per layer: None for global attention

    def attention(self, n: int, causal_sum: bool) -> int:
        """4·d_q times the attended context: summed over the n queries of a prefill, or for the last one."""
        total = 0
        for window in self.windows:
            total += _causal_context(n, window) if causal_sum else min(n, window or n)
        return 4 * self.query_width * total

    def prefill(self, n: int) -> int:
        return 2 * self.non_embedding_params * n + self.attention(n, causal_sum=True) + 2 * self.hidden * self.vocab

    def step(self, n: int) -> int:
        return 2 * self.non_embedding_params + self.attention(n, causal_sum=False) + 2 * self.hidden * self.vocab


def _causal_context(n: int, window: int | None) -> int:
    """Σ_{i=1..n} min(i, window): keys attended over a causal prefill."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def flop_model(model: nn.Module, layout: CacheLayout) -> FlopModel:
    """Read the FLOP model's quantities from a loaded causal LM."""
    config = model.config.get_text_config(decoder=True)
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None for p in m.parameters()}
    non_embedding = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    if hasattr(config, "kv_lora_rank"):  # MLA: each query head reads a NoPE part and the shared rotary part
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = tuple(layer.objects[0].window if layer.attention != GLOBAL else None for layer in layout.layers)
    return FlopModel(non_embedding, config.num_attention_heads * head_dim, config.hidden_size, config.vocab_size, windows)


# --- Measurement ----------------------------------------------------------------------------------


@dataclass
class SpeedRow:
    """One prefix length; times in seconds (medians over repeats), memory in MB, FLOPs absolute."""

    n: int
    switch_s: float  # translate + one target decoding step on x_n + picking the first token
    prefill_s: float  # the target's prefill of x_{1:n} + picking the first token
    ratio: float  # prefill_s / switch_s
    flop_ratio: float
    translate_s: float  # maps + writing the target cache (k-norm, RoPE), median
    step_s: float  # the target's step on x_n (+ first pick): switch time minus translation, median over runs
    switch_peak_mb: float  # evals.memory.peak_memory of the switch path (one untimed run)
    prefill_peak_mb: float  # same for the re-prefill path
    switch_decode_tok_s: float | None
    native_decode_tok_s: float | None
    map_flops: int
    step_flops: int
    prefill_flops: int
    first_token_match: bool  # the switched and re-prefilled paths chose the same first token (greedy)
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def measure_speed(
    source: Side,
    target: Side,
    translator: Translator | None,
    prompt_ids: torch.Tensor,
    *,
    point: str,
    repeats: int = 3,
    decode_tokens: int = 16,
) -> SpeedRow:
    """Time both paths to the first token for prompt x_{1:n}, then decode `decode_tokens` more after each;
    then one untimed run of each path under the memory probe.

    Args:
        prompt_ids: [n] token ids, n ≥ 2.
    Raises:
        ConfigError: n < 2, repeats < 1 or decode_tokens < 1.
    """
    n = int(prompt_ids.numel())
    if n < 2 or repeats < 1 or decode_tokens < 1:
        raise ConfigError(f"need n ≥ 2, repeats ≥ 1, decode_tokens ≥ 1 (got n={n}, repeats={repeats}, decode_tokens={decode_tokens})")
    with torch.no_grad():
        held = capture(source.model, source.layout, prompt_ids[:-1], point)  # the source's cache: untimed
    switch_runs, prefill_runs = [], []
    for r in range(repeats):
        last = r == repeats - 1  # decode after the last repeat only: it does not change the first token's time
        switch_runs.append(_switch_path(target, translator, held, prompt_ids, point, decode_tokens if last else 0))
        prefill_runs.append(_prefill_path(target, prompt_ids, decode_tokens if last else 0))
    device = target.model.device
    with torch.no_grad(), peak_memory(device) as switch_peak:
        _first_logits(target.model, translated_cache(target, translator, held, point), prompt_ids[-1:])
    with torch.no_grad(), peak_memory(device) as prefill_peak:
        _first_logits(target.model, DynamicCache(config=target.model.config), prompt_ids)
    peaks = (switch_peak.mb, prefill_peak.mb)
    return _row(n, switch_runs, prefill_runs, peaks, translator, flop_model(target.model, target.layout), repeats)


@dataclass
class _Run:
    ttft_s: float
    translate_s: float
    first_token: int
    decode_tok_s: float | None


def _first_logits(model: nn.Module, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
    """The model reads `ids` [k] on top of `cache` (extended in place): next-token logits [vocab]."""
    return decode_step(model, cache, ids, logits_to_keep=1)[-1]


def _switch_path(target: Side, translator, held, prompt_ids, point, decode_tokens: int) -> _Run:
    device = target.model.device
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        cache = translated_cache(target, translator, held, point)
        sync(device)
        translate_s = time.perf_counter() - t0
        logits = _first_logits(target.model, cache, prompt_ids[-1:])
        first = int(torch.argmax(logits))  # reading the token synchronises the device
        ttft = time.perf_counter() - t0
    return _Run(ttft, translate_s, first, _decode_speed(target, cache, logits, decode_tokens))


def _prefill_path(target: Side, prompt_ids, decode_tokens: int) -> _Run:
    device = target.model.device
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        cache = DynamicCache(config=target.model.config)
        logits = _first_logits(target.model, cache, prompt_ids)
        first = int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
    return _Run(ttft, 0.0, first, _decode_speed(target, cache, logits, decode_tokens))


def _decode_speed(target: Side, cache, logits, decode_tokens: int) -> float | None:
    """Greedy tokens per second over `decode_tokens` steps after the first token (None when 0)."""
    if decode_tokens == 0:
        return None
    with torch.no_grad():
        decoded = decode_from(target.model, cache, logits, GenerationSettings(max_new_tokens=decode_tokens + 1))
    return len(decoded.step_s) / decoded.decode_s if decoded.decode_s > 0 else None


def _row(n, switch_runs, prefill_runs, peaks: tuple[float, float], translator, flops: FlopModel, repeats) -> SpeedRow:
    switch_s = statistics.median(r.ttft_s for r in switch_runs)
    prefill_s = statistics.median(r.ttft_s for r in prefill_runs)
    translate_s = statistics.median(r.translate_s for r in switch_runs)
    map_flops = (translator.flops_per_token() if translator is not None else 0) * (n - 1)
    step_flops, prefill_flops = flops.step(n), flops.prefill(n)
    return SpeedRow(
        n=n,
        switch_s=switch_s,
        prefill_s=prefill_s,
        ratio=prefill_s / switch_s,
        flop_ratio=prefill_flops / (map_flops + step_flops),
        translate_s=translate_s,
        step_s=statistics.median(r.ttft_s - r.translate_s for r in switch_runs),
        switch_peak_mb=peaks[0],
        prefill_peak_mb=peaks[1],
        switch_decode_tok_s=switch_runs[-1].decode_tok_s,
        native_decode_tok_s=prefill_runs[-1].decode_tok_s,
        map_flops=map_flops,
        step_flops=step_flops,
        prefill_flops=prefill_flops,
        first_token_match=all(s.first_token == p.first_token for s, p in zip(switch_runs, prefill_runs)),
        repeats=repeats,
    )



# --- Cross-tokenizer pairs ------------------------------------------------------------------------


def measure_speed_cross(
    source: Side, target: Side, translator: Translator, sample, *, repeats: int = 3, decode_tokens: int = 16,
) -> SpeedRow:
    """`measure_speed` for a cross-tokenizer prompt (`translators.cross.CrossSample`): the switch translates the
    source's content tokens, writes them at their assigned positions and has the target prefill its own
    boilerplate (`mixed_cache`) — all inside translate_s — then steps on the last prompt token. n is the target's
    prompt length (what re-prefill reads).

    Raises:
        ConfigError: repeats < 1 or decode_tokens < 1.
    """
    from translators.cross import mixed_cache, positioned_step, source_capture, translated_tensors

    if repeats < 1 or decode_tokens < 1:
        raise ConfigError(f"need repeats ≥ 1 and decode_tokens ≥ 1 (got {repeats}, {decode_tokens})")
    prompt_ids = sample.target_ids
    n = int(prompt_ids.numel())
    point = translator.point
    with torch.no_grad():
        held = source_capture(source, sample, point)  # the source's cache: untimed

    def switch_cache():
        return mixed_cache(target.model, target.layout, sample, translated_tensors(translator, held, sample), point)

    def first_logits(cache):
        return positioned_step(n - 1)(target.model, cache, prompt_ids[-1:])

    switch_runs, prefill_runs = [], []
    device = target.model.device
    for r in range(repeats):
        last = r == repeats - 1
        with torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            cache = switch_cache()
            sync(device)
            translate_s = time.perf_counter() - t0
            logits = first_logits(cache)
            first = int(torch.argmax(logits))
            ttft = time.perf_counter() - t0
            decode = None
            if last:
                decoded = decode_from(target.model, cache, logits, GenerationSettings(max_new_tokens=decode_tokens + 1),
                                      step=positioned_step(n))
                decode = len(decoded.step_s) / decoded.decode_s if decoded.decode_s > 0 else None
        switch_runs.append(_Run(ttft, translate_s, first, decode))
        prefill_runs.append(_prefill_path(target, prompt_ids, decode_tokens if last else 0))
    with torch.no_grad(), peak_memory(device) as switch_peak:
        first_logits(switch_cache())
    with torch.no_grad(), peak_memory(device) as prefill_peak:
        _first_logits(target.model, DynamicCache(config=target.model.config), prompt_ids)
    row = _row(n, switch_runs, prefill_runs, (switch_peak.mb, prefill_peak.mb), None, flop_model(target.model, target.layout),
               repeats)
    map_flops = translator.flops_per_token() * int(sample.translated.numel())
    return replace(row, map_flops=map_flops, flop_ratio=row.prefill_flops / (map_flops + row.step_flops))
