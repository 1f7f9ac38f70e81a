"""Timing harness for switches into and out of hybrid caches (paper 004 §7, §9.1): time to first token after a
switch, broken down by stage, against the target's re-prefill, per state route.

Stages of a switch (each timed on its own, medians over repeats; the source's capture of x_{1:n-1} is taken
once, untimed: in deployment the source already holds its cache):

- ``maps_s``: the token-wise maps (attention K/V, and the replay maps' predicted mixer inputs);
- ``states_s``: state synthesis: copying (and correcting) the source's states, or replaying the target's own
  mixers over the predicted inputs;
- ``inject_s``: writing the target's cache (`translators.inject.write_hybrid_cache`);
- ``first_step_s``: the target reads the last prompt token on top of it and picks the first token.

Copy costs O(1) in the prompt length for the states (only the K/V maps of the attention layers grow with it);
replay runs one mixer pass per replayed layer, so it grows linearly, yet skips the MLPs and attention layers a
prefill runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from translators.capture import capture_hybrid
from translators.errors import ConfigError
from translators.generation import sync
from translators.inject import decode_step, write_hybrid_cache
from translators.stage1 import Side


@dataclass(frozen=True)
class HybridSpeedRow:
    """One prefix length and route: the switch's stages and total against re-prefill (seconds, medians)."""

    n: int
    route: str
    maps_s: float
    states_s: float
    inject_s: float
    first_step_s: float
    switch_s: float
    prefill_s: float
    ratio: float  # prefill_s / switch_s
    first_token_match: bool  # the switch's first greedy token equals re-prefill's in every repeat
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(fn):
    sync("cpu")
    t0 = time.perf_counter()
    out = fn()
    sync("cpu")
    return out, time.perf_counter() - t0


def _switch_once(source: Side, target: Side, translator, held, last_token: torch.Tensor) -> tuple[dict, int]:
    """One switch, stage by stage: ({stage: seconds}, first greedy token)."""
    def maps():
        return translator.map_tokens(held), translator.replay_inputs(held)

    with torch.no_grad():
        (tokens, inputs), maps_s = _timed(maps)
        synthesised, states_s = _timed(lambda: translator.synthesise_states(held, target.model, inputs))
        cache, inject_s = _timed(lambda: write_hybrid_cache(target.model, target.layout, tokens, synthesised,
                                                            point=translator.point))
        first, first_step_s = _timed(lambda: int(torch.argmax(decode_step(target.model, cache, last_token,
                                                                           logits_to_keep=1)[-1])))
    return {"maps_s": maps_s, "states_s": states_s, "inject_s": inject_s, "first_step_s": first_step_s}, first


def _prefill_once(target: Side, prompt_ids: torch.Tensor) -> tuple[float, int]:
    with torch.no_grad():
        first, seconds = _timed(lambda: int(torch.argmax(decode_step(
            target.model, DynamicCache(config=target.model.config), prompt_ids, logits_to_keep=1)[-1])))
    return seconds, first


def measure_hybrid_speed(source: Side, target: Side, translators: dict, prompt_ids: torch.Tensor, *,
                         repeats: int = 3) -> list[HybridSpeedRow]:
    """Time every route's switch (stage by stage) and the target's re-prefill for prompt x_{1:n}, interleaved
    repeat by repeat so both see the same machine load.

    Args:
        translators: route name → a fitted `translators.hybrid.HybridTranslator` (all at one capture point).
        prompt_ids: [n] token ids, n ≥ 2.
    Raises:
        ConfigError: n < 2, repeats < 1, no translators, or translators at different capture points.
    """
    n = int(prompt_ids.numel())
    if n < 2 or repeats < 1 or not translators:
        raise ConfigError(f"need n ≥ 2, repeats ≥ 1 and a translator (got n={n}, repeats={repeats}, "
                          f"{len(translators)} translators)")
    points = {tr.point for tr in translators.values()}
    if len(points) != 1:
        raise ConfigError(f"the routes read captures at different points {sorted(points)}; time them separately")
    with torch.no_grad():
        held = capture_hybrid(source.model, source.layout, prompt_ids[:-1], points.pop())  # untimed
    stages = {route: [] for route in translators}
    firsts = {route: [] for route in translators}
    prefill_s, prefill_first = [], []
    for _ in range(repeats):
        for route, translator in translators.items():
            timing, first = _switch_once(source, target, translator, held, prompt_ids[-1:])
            stages[route].append(timing)
            firsts[route].append(first)
        seconds, first = _prefill_once(target, prompt_ids)
        prefill_s.append(seconds)
        prefill_first.append(first)
    prefill = statistics.median(prefill_s)
    rows = []
    for route, runs in stages.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        switch = statistics.median(sum(run.values()) for run in runs)
        rows.append(HybridSpeedRow(n=n, route=route, **median, switch_s=switch, prefill_s=prefill,
                                   ratio=prefill / switch, first_token_match=firsts[route] == prefill_first,
                                   repeats=repeats))
    return rows
