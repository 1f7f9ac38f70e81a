"""Multi-turn model switching (paper §4.7, App. Q, Fig. 32): each model keeps its own cache line.

A `Conversation` holds one shared token history and, per model, a *cache line*: per-layer cache objects (keys
at the capture point and values), plus positions, for the first `seen` tokens of the history. The line mixes spans
the model computed itself (when it generated or read them) and spans translated from another model.

At `switch_to(model)`:
- `segment` (default, KV-Lingo): only the span written since that model last held the conversation is
  translated, each piece from the cache line of the model that wrote it natively, and appended at
  consecutive positions. No span passes through more than one translator.
- `naive`: the incoming model's line is replaced by a translation of the outgoing model's whole line, which
  holds spans it received translated itself: they go back and forth, once per switch, compounding error.
- `reprefill` (reference): the incoming model prefills the missing span itself; every line stays native.
- `refresh_every=k` (optional, any mode): a model whose line has held translated content for k or more
  generation turns re-prefills the whole history natively at its next switch instead of translating.

Keys and values of what the active model reads and generates are recorded from its own forward passes (hooks
on each cache object's module: k_proj/v_proj), so a model's line holds exactly the cache it decoded with, as in deployment.
`translation_counts` counts, per written span (start, end), how many times it has been translated.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from translators.capture import capture
from translators.errors import ConfigError, KvlingoError, PrefixTooLongError
from translators.generation import GenerationSettings, decode_from
from translators.inject import decode_step, write_cache
from translators.layout import CacheLayout, decoder_of
from translators.objects import cache_objects, object_width
from translators.stage1 import Side
from translators.switch import check_translator_fits, resolve_point, translate
from translators.translator import Translator

MODES = ("segment", "naive", "reprefill")


class ConversationStateError(KvlingoError):
    """An internal invariant of the cache lines broke (a bug, not bad input): the message says which."""


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the history, first computed natively by `writer`."""

    start: int
    end: int
    writer: str


@dataclass(frozen=True)
class LineSegment:
    """A piece [start, end) of one model's cache line: computed by `origin`, through `hops` translators."""

    start: int
    end: int
    origin: str
    hops: int  # 0: the line's own model computed it


@dataclass
class CacheLine:
    """One model's cache of the history's first `n_tokens` tokens.

    objects[name][l]: [n_entries, width] fp32 of cache object `name` (GQA: "keys" at capture point `point`,
    "values") in layer l; positions: [n_entries], the position each entry's key is rotated at. With one tokenizer
    every token has one entry at its own position (n_entries == n_tokens); a span translated across tokenizers
    (`translators.cross_conversation`) holds one entry per translated source token at its assigned position.
    """

    point: str
    objects: dict[str, list[torch.Tensor]]
    positions: torch.Tensor
    segments: list[LineSegment] = field(default_factory=list)
    translated_since_turn: int | None = None  # turn count when translated content first entered (None: native)
    covered: int = 0  # history tokens the line covers (the end of its last segment)

    @classmethod
    def empty(cls, layout: CacheLayout, point: str, device: torch.device) -> CacheLine:
        objects = {
            obj.name: [torch.zeros(0, object_width(obj, layout), device=device) for _ in range(layout.n_layers)]
            for obj in cache_objects(layout)
        }
        return cls(point, objects, torch.zeros(0, dtype=torch.long))

    @property
    def keys(self) -> list[torch.Tensor]:
        """GQA keys per layer (objects["keys"])."""
        return self.objects["keys"]

    @property
    def values(self) -> list[torch.Tensor]:
        """GQA values per layer (objects["values"])."""
        return self.objects["values"]

    @property
    def n_tokens(self) -> int:
        """History tokens the line covers."""
        return self.covered

    @property
    def n_entries(self) -> int:
        """Cache entries the line holds (n_tokens unless spans were translated across tokenizers)."""
        return int(self.positions.shape[0])

    def append(
        self, tensors: Mapping[str, Sequence[torch.Tensor]], start: int, origin: str, hops: int, *,
        positions: torch.Tensor | None = None, end: int | None = None,
    ) -> None:
        """Append a span covering history tokens [start, end) (start must equal n_tokens: lines grow without gaps).

        Args:
            tensors: object name → per layer [n_new, width], for every object of the line.
            positions: [n_new] where each entry's key is rotated, inside [start, end); default start..start+n_new-1.
            end: the end of the covered span; default start + n_new (one entry per token).
        Raises:
            ConversationStateError: a gap or overlap, other objects, a wrong number of layers, or positions outside
                the span.
        """
        if start != self.n_tokens:
            raise ConversationStateError(f"a span starting at {start} cannot follow a line of {self.n_tokens} tokens")
        if set(tensors) != set(self.objects) or any(len(tensors[name]) != len(xs) for name, xs in self.objects.items()):
            expected = ", ".join(f"{len(xs)} {name}" for name, xs in self.objects.items())
            given = ", ".join(f"{len(xs)} {name}" for name, xs in tensors.items())
            raise ConversationStateError(f"expected layers of {expected}, got {given}")
        first = next(iter(self.objects))
        n = int(tensors[first][0].shape[0])
        device = self.objects[first][0].device
        self.objects = {
            name: [torch.cat([old, new.detach().to(device, torch.float32)]) for old, new in zip(xs, tensors[name])]
            for name, xs in self.objects.items()
        }
        end = start + n if end is None else end
        positions = torch.arange(start, start + n) if positions is None else positions.detach().cpu().long()
        if positions.shape != (n,) or (n and (int(positions.min()) < start or int(positions.max()) >= end)):
            raise ConversationStateError(f"{n} entries need {n} positions inside the span [{start}, {end}), got "
                                         f"{positions.tolist()}")
        self.positions = torch.cat([self.positions, positions])
        self.covered = end
        if end > start:
            self.segments.append(LineSegment(start, end, origin, hops))

    def slice(self, start: int, end: int) -> dict[str, list[torch.Tensor]]:
        """Each object's tokens [start, end): name → list over layers of [end - start, width]."""
        return {name: [x[start:end] for x in xs] for name, xs in self.objects.items()}

    def to_cache(self, side: Side) -> DynamicCache:
        """A fresh engine cache holding this line (the model's k-norm and RoPE applied at the line's positions)."""
        if self.n_entries == 0:
            return DynamicCache(config=side.model.config)
        return write_cache(side.model, side.layout, self.objects, point=self.point, positions=self.positions)


@dataclass
class TurnResult:
    """One generation turn of the active model."""

    model: str
    start: int  # history position of the first generated token
    token_ids: list[int]
    text: str | None
    stopped: str
    read_s: float  # forward over the tokens the model had not read yet (ends with the first prediction)
    decode_s: float


@dataclass
class SwitchRecord:
    """What one `switch_to` did."""

    source: str
    target: str
    how: str  # "segment" | "naive" | "reprefill" | "refresh" | "none"
    spans: list[tuple[int, int]]  # history spans that were translated (empty for reprefill/refresh/none)
    n_tokens: int  # tokens translated or re-prefilled
    seconds: float


class Conversation:
    """A shared history that several models take turns on, each keeping its own cache line.

    Args:
        models: name → Side (model and layout). Same tokenizer for all.
        holder: the model that holds the conversation first.
        translators: (from, to) → Translator, or None for the identity (copies of one model); every ordered
            pair of distinct names. Default: identity everywhere.
        mode: "segment" | "naive" | "reprefill".
        refresh_every: re-prefill a line natively after this many turns with translated content (None: never).
        point: capture point when every translator is the identity (default pre_norm).
        tokenizer: decodes turn texts when given.
    Raises:
        ConfigError: unknown mode/holder, missing translator, translators at different points, refresh_every < 1.
        PairMismatchError: a translator that does not fit its pair.
    """

    def __init__(
        self,
        models: Mapping[str, Side],
        *,
        holder: str,
        translators: Mapping[tuple[str, str], Translator | None] | None = None,
        mode: str = "segment",
        refresh_every: int | None = None,
        point: str | None = None,
        tokenizer: Any = None,
    ):
        self.models = dict(models)
        _check_mode(mode)
        _check_refresh(refresh_every)
        self.mode, self.refresh_every, self.tokenizer = mode, refresh_every, tokenizer
        self.translators = _complete_translators(self.models, translators)
        self.point = _common_point(self.translators, point)
        self.holder = self._name(holder)
        self.tokens: list[int] = []
        self.spans: list[Span] = []
        self.translation_counts: dict[tuple[int, int], int] = {}
        self.n_turns = 0
        self.events: list[TurnResult | SwitchRecord] = []
        self.lines = {
            name: CacheLine.empty(side.layout, self.point, side.model.device) for name, side in self.models.items()
        }

    # --- Public API -------------------------------------------------------------------------------

    @property
    def max_positions(self) -> int:
        """Positions every model can read: the history must fit all of them."""
        return min(side.layout.max_positions for side in self.models.values())

    def seen(self, name: str) -> int:
        """How many tokens of the history `name`'s cache line covers."""
        return self.lines[self._name(name)].n_tokens

    def line_segments(self, name: str) -> list[LineSegment]:
        return list(self.lines[self._name(name)].segments)

    def append(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Add tokens to the shared history (e.g. a rendered user turn); the next holder to generate reads them.

        Raises:
            ConfigError: no tokens. PrefixTooLongError: the history would exceed a model's positions.
        """
        ids = appended_ids(token_ids)
        check_positions(len(self.tokens) + len(ids), self.max_positions, "appending these tokens")
        self.tokens.extend(ids)

    def generate(self, settings: GenerationSettings | None = None) -> TurnResult:
        """The holder reads the tokens its line lacks and generates; its own cache objects join its line.

        Raises:
            ConfigError: empty history, invalid settings. PrefixTooLongError: history + budget beyond positions.
        """
        settings = generation_settings(self.tokens, settings, self.max_positions)
        name, side, line = self.holder, self.models[self.holder], self.lines[self.holder]
        start = line.n_tokens
        if start != self._written():
            raise ConversationStateError(f"{name} covers {start} tokens but {self._written()} were written")
        pending = torch.tensor(self.tokens[start:])
        with torch.no_grad(), _recording(side) as raw:
            cache = line.to_cache(side)
            t0 = time.perf_counter()
            logits = decode_step(side.model, cache, pending, logits_to_keep=1)[-1]
            read_s = time.perf_counter() - t0
            decoded = decode_from(side.model, cache, logits, settings)
        # The last generated token was not fed back, so the recorded rows stop just before it.
        count = pending.numel() + len(decoded.token_ids) - 1
        line.append(_own_objects(side, raw, start, count, self.point), start, origin=name, hops=0)
        return record_turn(self, Span(start, start + count, name), decoded, read_s)

    def switch_to(self, name: str) -> SwitchRecord:
        """Hand the conversation to `name`, bringing its cache line up to date by the conversation's mode.

        Raises:
            ConfigError: unknown model name.
        """
        return route_switch(self, name)

    def max_translation_count(self) -> int:
        """The most times any written span has been translated (1 at most in segment mode)."""
        return max(self.translation_counts.values(), default=0)

    # --- Switch strategies ------------------------------------------------------------------------

    def _switch_segment(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Translate each span the incoming line lacks from the line of the model that wrote it."""
        line = self.lines[incoming]
        upto = self.lines[outgoing].n_tokens
        done = []
        for span in self.spans:
            start, end = max(span.start, line.n_tokens), min(span.end, upto)
            if start >= end:
                continue
            writer = self.lines[span.writer]
            _check_native(writer, span)
            line.append(translate(self.translators[(span.writer, incoming)], writer.slice(start, end)), start,
                        origin=span.writer, hops=1)
            if line.translated_since_turn is None:
                line.translated_since_turn = self.n_turns
            self.translation_counts[(span.start, span.end)] += 1
            done.append((start, end))
        return SwitchRecord(outgoing, incoming, "segment", done, sum(e - s for s, e in done), 0.0)

    def _switch_naive(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Replace the incoming line by a translation of the outgoing model's whole line."""
        source = self.lines[outgoing]
        translated = translate(self.translators[(outgoing, incoming)], source.objects)
        side = self.models[incoming]
        fresh = CacheLine.empty(side.layout, self.point, side.model.device)
        previous = self.lines[incoming].translated_since_turn
        fresh.translated_since_turn = self.n_turns if previous is None else previous
        for seg in source.segments:
            fresh.append({name: [x[seg.start:seg.end] for x in xs] for name, xs in translated.items()},
                         seg.start, origin=seg.origin, hops=seg.hops + 1)
        self.lines[incoming] = fresh
        for span in self.spans:
            if span.end <= source.n_tokens:
                self.translation_counts[(span.start, span.end)] += 1
        spans = [(s.start, s.end) for s in self.spans if s.end <= source.n_tokens]
        return SwitchRecord(outgoing, incoming, "naive", spans, source.n_tokens, 0.0)

    def _switch_reprefill(self, outgoing: str, incoming: str) -> SwitchRecord:
        """The incoming model reads the tokens its line lacks itself (exact reference)."""
        line = self.lines[incoming]
        start, upto = line.n_tokens, self.lines[outgoing].n_tokens
        if upto > start:
            self._read_natively(incoming, start, upto)
        return SwitchRecord(outgoing, incoming, "reprefill", [], max(0, upto - start), 0.0)

    def _refresh(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Rebuild the incoming line by a native prefill of the whole history its line should cover."""
        upto = self.lines[outgoing].n_tokens
        side = self.models[incoming]
        line = CacheLine.empty(side.layout, self.point, side.model.device)
        if upto:
            with torch.no_grad():
                cap = capture(side.model, side.layout, torch.tensor(self.tokens[:upto]), self.point)
            line.append(cap.objects, 0, origin=incoming, hops=0)
        self.lines[incoming] = line
        return SwitchRecord(outgoing, incoming, "refresh", [], upto, 0.0)

    def _needs_refresh(self, name: str) -> bool:
        since = self.lines[name].translated_since_turn
        return self.refresh_every is not None and since is not None and self.n_turns - since >= self.refresh_every

    def _read_natively(self, name: str, start: int, end: int) -> None:
        """`name` runs over history tokens [start, end) on top of its line; their cache objects join it."""
        side, line = self.models[name], self.lines[name]
        with torch.no_grad(), _recording(side) as raw:
            decode_step(side.model, line.to_cache(side), torch.tensor(self.tokens[start:end]), logits_to_keep=1)
        line.append(_own_objects(side, raw, start, end - start, self.point), start, origin=name, hops=0)

    # --- Helpers ----------------------------------------------------------------------------------

    def _written(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def _name(self, name: str) -> str:
        return _model_name(self.models, name)


# --- Module helpers -------------------------------------------------------------------------------


def appended_ids(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """Token ids to append to a history, as ints.

    Raises:
        ConfigError: no tokens.
    """
    ids = [int(t) for t in torch.as_tensor(token_ids, dtype=torch.long).view(-1)]
    if not ids:
        raise ConfigError("nothing to append: give at least one token id")
    return ids


def check_positions(n_positions: int, max_positions: int, what: str) -> None:
    """Raises PrefixTooLongError when a history of ``n_positions`` would not fit the models' positions."""
    if n_positions > max_positions:
        raise PrefixTooLongError(
            f"{what} needs {n_positions} positions but the conversation's models read at most "
            f"{max_positions}; start a new conversation or generate fewer tokens"
        )


def generation_settings(tokens: Sequence[int], settings: GenerationSettings | None, max_positions: int
                        ) -> GenerationSettings:
    """The turn's settings (default ones when None), checked against the history.

    Raises:
        ConfigError: empty history, invalid settings. PrefixTooLongError: history + budget beyond positions.
    """
    settings = settings or GenerationSettings()
    settings.check()
    if not tokens:
        raise ConfigError("the conversation is empty: append the prompt's token ids before generating")
    check_positions(len(tokens) + settings.max_new_tokens - 1, max_positions,
                    f"generating {settings.max_new_tokens} tokens")
    return settings


def record_turn(conv, span: Span, decoded, read_s: float) -> TurnResult:
    """Book a generation turn of ``conv`` (a `Conversation` or `HybridConversation`): the span its holder now
    holds natively (counted with no translations yet), the generated tokens appended to the history, the turn
    event. ``decoded``: the `translators.generation.Decoded` of the turn."""
    if span.end > span.start:
        conv.spans.append(span)
        conv.translation_counts[(span.start, span.end)] = 0
    position = len(conv.tokens)
    conv.tokens.extend(decoded.token_ids)
    conv.n_turns += 1
    text = conv.tokenizer.decode(decoded.token_ids, skip_special_tokens=True) if conv.tokenizer is not None else None
    turn = TurnResult(span.writer, position, decoded.token_ids, text, decoded.stopped, read_s, decoded.decode_s)
    conv.events.append(turn)
    return turn


def route_switch(conv, name: str) -> SwitchRecord:
    """Hand ``conv`` (a `Conversation` or `translators.hybrid_conversation.HybridConversation`) to ``name`` by its
    mode (refresh first when due), record the switch and make ``name`` the holder.

    Raises:
        ConfigError: unknown model name.
    """
    name = _model_name(conv.models, name)
    outgoing = conv.holder
    started = time.perf_counter()
    if name == outgoing:
        record = SwitchRecord(outgoing, name, "none", [], 0, 0.0)
    elif conv._needs_refresh(name):
        record = conv._refresh(outgoing, name)
    elif conv.mode == "segment":
        record = conv._switch_segment(outgoing, name)
    elif conv.mode == "naive":
        record = conv._switch_naive(outgoing, name)
    else:
        record = conv._switch_reprefill(outgoing, name)
    record.seconds = time.perf_counter() - started
    conv.holder = name
    conv.events.append(record)
    return record


def _model_name(models: Mapping[str, Any], name: str) -> str:
    """`name` when it names one of `models`.

    Raises:
        ConfigError: an unknown name, with the closest known one.
    """
    if name not in models:
        close = difflib.get_close_matches(str(name), list(models), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown model {name!r} in this conversation{hint} (models: {', '.join(models)})")
    return name


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        close = difflib.get_close_matches(mode, MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown conversation mode {mode!r}{hint} (choose from {', '.join(MODES)})")


def _check_refresh(refresh_every: int | None) -> None:
    if refresh_every is not None and (isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1):
        raise ConfigError(f"refresh_every must be a positive number of turns or None, got {refresh_every!r}")


def _complete_translators(
    models: dict[str, Side], given: Mapping[tuple[str, str], Translator | None] | None
) -> dict[tuple[str, str], Translator | None]:
    """A translator (or identity) for every ordered pair of distinct models, each checked against its pair."""
    if len(models) < 2:
        raise ConfigError(f"a conversation needs at least two models to switch between, got {len(models)}")
    pairs = [(a, b) for a in models for b in models if a != b]
    if given is None:
        given = {pair: None for pair in pairs}
    unknown = [pair for pair in given if pair not in pairs]
    missing = [pair for pair in pairs if pair not in given]
    if unknown or missing:
        raise ConfigError(
            "translators must cover every ordered pair of distinct models exactly: "
            + (f"missing {missing}" if missing else "")
            + ("; " if unknown and missing else "")
            + (f"unknown {unknown}" if unknown else "")
        )
    for (a, b), translator in given.items():
        check_translator_fits(translator, models[a].layout, models[b].layout)
    return dict(given)


def _common_point(translators: Mapping[tuple[str, str], Translator | None], point: str | None) -> str:
    """Every line stores keys at one capture point, so every translator must act there."""
    points = {resolve_point(t, point) for t in translators.values()}
    if len(points) != 1:
        raise ConfigError(f"the conversation's translators act at different capture points {sorted(points)}; use one point")
    return points.pop()


def _check_native(line: CacheLine, span: Span) -> None:
    """The writer's line must hold its own (untranslated) cache of the span it wrote."""
    for seg in line.segments:
        if seg.start < span.end and span.start < seg.end and seg.hops != 0:
            raise ConversationStateError(f"{span.writer}'s line holds span {span.start}-{span.end} translated")


@contextmanager
def _recording(side: Side) -> Iterator[dict[str, dict[int, list[torch.Tensor]]]]:
    """Record every cache object's module output (pre_norm; GQA: k_proj/v_proj) of the model's forwards, per
    object and layer."""
    objects = cache_objects(side.layout)
    raw: dict[str, dict[int, list[torch.Tensor]]] = {obj.name: {} for obj in objects}
    handles = []

    def keep(name: str, layer: int):
        def hook(_module, _inputs, output):
            raw[name].setdefault(layer, []).append(output[0].detach())  # [n_new, width]

        return hook

    for i, layer in enumerate(decoder_of(side.model).layers):
        for obj in objects:
            handles.append(obj.module(layer).register_forward_hook(keep(obj.name, i)))
    try:
        yield raw
    finally:
        for h in handles:
            h.remove()


def _own_objects(side: Side, raw, start: int, count: int, point: str) -> dict[str, list[torch.Tensor]]:
    """Recorded rows for history tokens [start, start + count), each object moved to `point` (name → per layer
    [count, width]).

    Raises:
        ConversationStateError: the recorded rows do not cover exactly `count` tokens.
    """
    positions = torch.arange(start, start + count)
    objects = cache_objects(side.layout)
    out: dict[str, list[torch.Tensor]] = {obj.name: [] for obj in objects}
    for layer in range(side.layout.n_layers):
        rows = {obj.name: obj.read(side.layout.layers[layer], torch.cat(raw[obj.name][layer])) for obj in objects}
        if any(x.shape[0] != count for x in rows.values()):
            found = ", ".join(f"{x.shape[0]} {name}" for name, x in rows.items())
            raise ConversationStateError(f"recorded {found} rows for {count} tokens in layer {layer}")
        for obj in objects:
            out[obj.name].append(
                obj.advance(side.model, side.layout, layer, rows[obj.name], start="pre_norm", end=point, positions=positions)
            )
    return out
