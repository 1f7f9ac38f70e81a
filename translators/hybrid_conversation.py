"""Multi-turn switching between hybrid models (paper 004 §8): segment-wise hand-off of attention K/V and states.

Like `translators.conversation.Conversation` (one tokenizer, one shared history, a cache line per model), except
that a linear-attention layer's cache is one state for the whole prefix: it cannot be sliced or appended to, only
carried forward. So each model keeps

- its live engine cache over the first ``seen`` tokens of the history (attention K/V, conv windows, states), and
- its *line*: the per-token objects of its attention layers at the translators' capture point over the same
  tokens (recorded from its own forwards where it computed them, translated where it received them), which is
  what it hands on when it is the writer.

At ``switch_to(B)``:
- ``segment`` (default): each span B lacks is translated once, from the line of the model that wrote it natively,
  and appended to B's cache: K/V at consecutive positions; B's replayed linear layers run their own recurrence
  over the span's predicted inputs, continuing from B's state (so B's earlier content stays its own); copied
  (corrected) layers take the writer's current state through the map (O(1): a state summarises the whole prefix,
  so the writer's state of the last span is copied); zero layers are reset.
- ``naive``: B's cache is rebuilt from a translation of the outgoing model's whole line (content it received
  translated is translated again) and its current states; replayed layers run from an empty state over it all.
- ``reprefill`` (reference): B reads the tokens it lacks itself.
- ``refresh_every=k`` (any mode): a model whose cache has held translated content for k or more generation turns
  re-prefills the whole history natively at its next switch.

`translation_counts` counts, per written span (start, end), how many times it has been translated.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from translators.capture import HybridCapture
from translators.conversation import (
    Span,
    SwitchRecord,
    TurnResult,
    _check_mode,
    _check_refresh,
    _model_name,
    appended_ids,
    check_positions,
    generation_settings,
    record_turn,
    route_switch,
)
from translators.errors import ConfigError
from translators.generation import GenerationSettings, decode_from
from translators.hybrid import HybridTranslator
from translators.inject import decode_step
from translators.layout import decoder_of
from translators.objects import CacheObject, StateObject, engine_tensor, fill_cache_layer, layer_objects
from translators.replay import replay_mixer
from translators.stage1 import Side
from translators.states import CONV, REPLAY, STATE, ZERO


@dataclass
class _Holder:
    """One model's live cache and line. line[name][layer]: [n_tokens, width] at the capture point."""

    cache: DynamicCache
    line: dict[str, dict[int, torch.Tensor]]
    seen: int = 0
    translated_since_turn: int | None = None


def _token_objects(side: Side) -> list[tuple[int, CacheObject]]:
    return [(i, obj) for i in range(side.layout.n_layers) for obj in layer_objects(side.layout, i)
            if isinstance(obj, CacheObject)]


def _empty(side: Side) -> _Holder:
    line: dict[str, dict[int, torch.Tensor]] = {}
    for i, obj in _token_objects(side):
        line.setdefault(obj.name, {})[i] = torch.zeros(0, obj.width(side.layout.layers[i]))
    return _Holder(DynamicCache(config=side.model.config), line)


class HybridConversation:
    """A shared history that hybrid (or GQA) models of one tokenizer take turns on.

    Args:
        models: name → Side (model and layout); one tokenizer for all, at least one hybrid.
        holder: the model that holds the conversation first.
        translators: (from, to) → `translators.hybrid.HybridTranslator` for every ordered pair of distinct names,
            all at one capture point.
        mode: "segment" | "naive" | "reprefill".
        refresh_every: re-prefill a model natively after this many turns with translated content (None: never).
        tokenizer: decodes turn texts when given.
    Raises:
        ConfigError: unknown mode/holder, a missing translator, translators at different points, refresh_every < 1.
    """

    def __init__(self, models: Mapping[str, Side], *, holder: str,
                 translators: Mapping[tuple[str, str], HybridTranslator], mode: str = "segment",
                 refresh_every: int | None = None, tokenizer: Any = None):
        self.models = dict(models)
        _check_mode(mode)
        _check_refresh(refresh_every)
        missing = [(a, b) for a in self.models for b in self.models if a != b and (a, b) not in translators]
        if missing:
            raise ConfigError(f"a translator is needed for every ordered pair of models; missing {missing}")
        points = {tr.point for tr in translators.values()}
        if len(points) != 1:
            raise ConfigError(f"the translators read captures at different points {sorted(points)}; fit them at one")
        self.point = points.pop()
        self.translators = dict(translators)
        self.mode, self.refresh_every, self.tokenizer = mode, refresh_every, tokenizer
        self.holder = _model_name(self.models, holder)
        self.tokens: list[int] = []
        self.spans: list[Span] = []
        self.translation_counts: dict[tuple[int, int], int] = {}
        self.n_turns = 0
        self.events: list[TurnResult | SwitchRecord] = []
        self.held = {name: _empty(side) for name, side in self.models.items()}

    # --- Public API (as `translators.conversation.Conversation`) -----------------------------------

    @property
    def max_positions(self) -> int:
        return min(side.layout.max_positions for side in self.models.values())

    def seen(self, name: str) -> int:
        """How many tokens of the history `name`'s cache covers."""
        return self.held[_model_name(self.models, name)].seen

    def append(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Add tokens to the shared history; the next holder to generate reads them.

        Raises:
            ConfigError: no tokens. PrefixTooLongError: the history would exceed a model's positions.
        """
        ids = appended_ids(token_ids)
        check_positions(len(self.tokens) + len(ids), self.max_positions, "appending these tokens")
        self.tokens.extend(ids)

    def generate(self, settings: GenerationSettings | None = None) -> TurnResult:
        """The holder reads the tokens it lacks and generates; its own objects join its line.

        Raises:
            ConfigError: empty history, invalid settings. PrefixTooLongError: history + budget beyond positions.
        """
        settings = generation_settings(self.tokens, settings, self.max_positions)
        name, side, held = self.holder, self.models[self.holder], self.held[self.holder]
        start = held.seen
        pending = torch.tensor(self.tokens[start:])
        with torch.no_grad(), _recording(side) as raw:
            t0 = time.perf_counter()
            logits = decode_step(side.model, held.cache, pending, logits_to_keep=1)[-1]
            read_s = time.perf_counter() - t0
            decoded = decode_from(side.model, held.cache, logits, settings)
        count = pending.numel() + len(decoded.token_ids) - 1  # the last generated token was not fed back
        self._extend_line(held, _own_objects(side, raw, start, count, self.point), count)
        return record_turn(self, Span(start, start + count, name), decoded, read_s)

    def switch_to(self, name: str) -> SwitchRecord:
        """Hand the conversation to `name`, bringing its cache up to date by the conversation's mode.

        Raises:
            ConfigError: unknown model name.
        """
        return route_switch(self, name)

    def max_translation_count(self) -> int:
        """The most times any written span has been translated (1 at most in segment mode)."""
        return max(self.translation_counts.values(), default=0)

    # --- Switch strategies ------------------------------------------------------------------------

    def _switch_segment(self, outgoing: str, incoming: str) -> SwitchRecord:
        held, upto = self.held[incoming], self.held[outgoing].seen
        done = []
        for span in self.spans:
            start, end = max(span.start, held.seen), min(span.end, upto)
            if start >= end:
                continue
            writer = self.held[span.writer]
            piece = {name: {i: x[start:end] for i, x in xs.items()} for name, xs in writer.line.items()}
            self._receive(incoming, span.writer, piece, start, end, writer_states=_states(writer.cache, self.models[span.writer]))
            self.translation_counts[(span.start, span.end)] += 1
            done.append((start, end))
        return SwitchRecord(outgoing, incoming, "segment", done, sum(e - s for s, e in done), 0.0)

    def _switch_naive(self, outgoing: str, incoming: str) -> SwitchRecord:
        source = self.held[outgoing]
        since = self.held[incoming].translated_since_turn
        self.held[incoming] = _empty(self.models[incoming])
        self.held[incoming].translated_since_turn = since
        if source.seen:
            self._receive(incoming, outgoing, source.line, 0, source.seen,
                          writer_states=_states(source.cache, self.models[outgoing]))
        spans = [(s.start, s.end) for s in self.spans if s.end <= source.seen]
        for span in spans:
            self.translation_counts[span] += 1
        return SwitchRecord(outgoing, incoming, "naive", spans, source.seen, 0.0)

    def _switch_reprefill(self, outgoing: str, incoming: str) -> SwitchRecord:
        held, upto = self.held[incoming], self.held[outgoing].seen
        if upto > held.seen:
            self._read_natively(incoming, held.seen, upto)
        return SwitchRecord(outgoing, incoming, "reprefill", [], max(0, upto - held.seen), 0.0)

    def _refresh(self, outgoing: str, incoming: str) -> SwitchRecord:
        upto = self.held[outgoing].seen
        self.held[incoming] = _empty(self.models[incoming])
        if upto:
            self._read_natively(incoming, 0, upto)
        return SwitchRecord(outgoing, incoming, "refresh", [], upto, 0.0)

    # --- Helpers ----------------------------------------------------------------------------------

    def _receive(self, incoming: str, writer: str, piece: Mapping[str, Mapping[int, torch.Tensor]], start: int,
                 end: int, *, writer_states: Mapping[str, Mapping[int, torch.Tensor]]) -> None:
        """Append history tokens [start, end), translated from ``writer``'s objects ``piece``, to ``incoming``."""
        translator, side, held = self.translators[(writer, incoming)], self.models[incoming], self.held[incoming]
        capture = HybridCapture(point=self.point, tokens=piece, states=writer_states,
                                positions=torch.arange(start, end), token_ids=torch.tensor(self.tokens[start:end]))
        with torch.no_grad():
            tokens = translator.map_tokens(capture)
            positions = torch.arange(start, end)
            dtype = next(side.model.parameters()).dtype
            for i in range(side.layout.n_layers):
                objects = layer_objects(side.layout, i)
                if isinstance(objects[0], CacheObject):
                    fill_cache_layer(held.cache, i, objects, [
                        engine_tensor(obj, side.model, side.layout, i, tokens[obj.name][i].to(dtype), point=self.point,
                                      positions=positions) for obj in objects])
            self._receive_states(translator, side, held, capture)
        self._extend_line(held, tokens, end - start)
        if held.translated_since_turn is None:
            held.translated_since_turn = self.n_turns

    def _receive_states(self, translator: HybridTranslator, side: Side, held: _Holder, capture: HybridCapture) -> None:
        """Linear layers: replayed ones continue their own recurrence over the span; others are overwritten."""
        strategies = translator.states.strategies
        if not strategies:
            return
        replayed = [t for t, s in strategies.items() if s == REPLAY]
        for t, u in translator.replay_inputs(capture).items():
            replay_mixer(side.model, t, u, held.cache)  # continues the receiver's own state, in place
        others = translator.states(capture.states)
        for t in strategies:
            if t in replayed:
                continue
            if strategies[t] == ZERO:
                _write_state(held.cache, side, t, torch.zeros_like(others[CONV][t]), torch.zeros_like(others[STATE][t]))
            else:
                _write_state(held.cache, side, t, others[CONV][t], others[STATE][t])

    def _read_natively(self, name: str, start: int, end: int) -> None:
        side, held = self.models[name], self.held[name]
        with torch.no_grad(), _recording(side) as raw:
            decode_step(side.model, held.cache, torch.tensor(self.tokens[start:end]), logits_to_keep=1)
        self._extend_line(held, _own_objects(side, raw, start, end - start, self.point), end - start)

    @staticmethod
    def _extend_line(held: _Holder, objects: Mapping[str, Mapping[int, torch.Tensor]], count: int) -> None:
        for name, layers in held.line.items():
            for i in layers:
                layers[i] = torch.cat([layers[i], objects[name][i].detach().float()])
        held.seen += count

    def _needs_refresh(self, name: str) -> bool:
        since = self.held[name].translated_since_turn
        return self.refresh_every is not None and since is not None and self.n_turns - since >= self.refresh_every


def _states(cache: DynamicCache, side: Side) -> dict[str, dict[int, torch.Tensor]]:
    """The conv windows and states a model's live cache holds, {kind: {linear layer: tensor}} (none for GQA)."""
    out: dict[str, dict[int, torch.Tensor]] = {CONV: {}, STATE: {}}
    for i in range(side.layout.n_layers):
        for obj in layer_objects(side.layout, i):
            if isinstance(obj, StateObject):
                out[obj.name][i] = obj.read(cache, i).clone()
    return out


def _write_state(cache: DynamicCache, side: Side, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
    """Overwrite a linear layer's conv window and state (the window first, as the engine writes them)."""
    from translators.objects import CONV_WINDOW, RECURRENT_STATE

    dtype = next(side.model.parameters()).dtype
    CONV_WINDOW.write(cache, layer, conv.to(dtype))
    RECURRENT_STATE.write(cache, layer, state.to(dtype))


@contextmanager
def _recording(side: Side) -> Iterator[dict[str, dict[int, list[torch.Tensor]]]]:
    """Record every per-token object's module output (pre_norm) of the model's forwards, per object and layer."""
    raw: dict[str, dict[int, list[torch.Tensor]]] = {}
    handles = []

    def keep(name: str, layer: int):
        def hook(_module, _inputs, output):
            raw.setdefault(name, {}).setdefault(layer, []).append(output[0].detach())  # [n_new, ≥ width]

        return hook

    layers = decoder_of(side.model).layers
    for i, obj in _token_objects(side):
        handles.append(obj.module(layers[i]).register_forward_hook(keep(obj.name, i)))
    try:
        yield raw
    finally:
        for h in handles:
            h.remove()


def _own_objects(side: Side, raw, start: int, count: int, point: str) -> dict[str, dict[int, torch.Tensor]]:
    """Recorded rows of history tokens [start, start + count) per object and attention layer, at `point`."""
    from translators.conversation import ConversationStateError

    positions = torch.arange(start, start + count)
    out: dict[str, dict[int, torch.Tensor]] = {}
    for i, obj in _token_objects(side):
        rows = obj.read(side.layout.layers[i], torch.cat(raw[obj.name][i]))
        if rows.shape[0] != count:
            raise ConversationStateError(f"recorded {rows.shape[0]} {obj.name} rows for {count} tokens in layer {i}")
        out.setdefault(obj.name, {})[i] = obj.advance(side.model, side.layout, i, rows, start="pre_norm", end=point,
                                                      positions=positions)
    return out
