"""Multi-turn hand-off between models that tokenize differently (paper §4.7 with App. K).

The history is a list of messages (text). Each model renders it in its own format (`ModelFormat`: its chat
template, or the plain "User:/Assistant:" format of a base model) into its own *transcript* (text, token ids and,
per token, the message content it holds or None for boilerplate) and keeps its own cache line
(`translators.conversation.CacheLine`) over its transcript. Transcripts grow block by block: each new block of
rendered text is tokenized on its own, so a model's tokens of earlier turns never change.

Messages are *written* by the model that first read them natively: the holder, when it generates, reads the
messages appended since its line ended and writes its answer. After its turn the holder's line covers its whole
transcript (the last generated token, any token where its format's tokenization of the answer text differs from
what it generated, and the end-of-turn delimiter are read natively right away), so a writer's line always holds
its own messages natively.

At `switch_to(receiver)` the receiver's line is brought up to the end of the written messages:
- `segment` (default): for each written message it lacks, the content tokens of the message's writer (from the
  writer's line, native entries only) are translated (writer → receiver translator) and each entry's key rotated
  at the receiver position of the receiver token it is assigned to (`translators.alignment.align` on the
  message's content, minimal groups and spread assignment), after the receiver's existing line; the receiver's
  own boilerplate (turn headers, delimiters) is prefilled by the receiver on top of what precedes it, as
  `translators.cross.mixed_cache` does for one prefix. Each written span is translated once per receiver.
- `naive`: the receiver's line is replaced by a translation of the outgoing model's whole line (the entries at
  its content tokens, translated ones included), so content goes back and forth, compounding error.
- `reprefill` (reference): the receiver reads its missing transcript tokens itself.
- `refresh_every=k`: a line that has held translated content for k or more turns is rebuilt natively at its
  next switch.

A message whose two tokenizations do not cover the same characters raises the alignment's error by default
(`unaligned="error"`); with `unaligned="prefill"` the receiver reads that message itself (as the single-prefix
samples do) and the fallback is listed in `fallbacks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from translators.alignment import AlignmentError, Span, align, content_spans, content_tokens, token_offsets
from translators.conversation import (
    CacheLine,
    ConversationStateError,
    SwitchRecord,
    TurnResult,
    _check_mode,
    _check_refresh,
    _common_point,
    _complete_translators,
    _model_name,
    _own_objects,
    _recording,
)
from translators.cross import positioned_step, prefill_run, write_run
from translators.errors import ConfigError, PrefixTooLongError
from translators.generation import GenerationSettings, decode_from
from translators.inject import decode_step
from translators.stage1 import Side
from translators.switch import translate
from translators.translator import Translator

UNALIGNED = ("error", "prefill")


@dataclass(frozen=True)
class ModelFormat:
    """How one model writes a conversation (built by `infra.cross_samples.model_format`).

    Attributes:
        tokenizer: a fast tokenizer (character offsets are needed).
        render: (messages, generation_prompt=bool) → the text of the messages in the model's format; the render of
            a conversation must start with the render of any earlier state of it.
        lead_ids: ids the model reads before its rendered text that the text does not hold (a base model's BOS).
    """

    tokenizer: Any
    render: Callable[..., str]
    lead_ids: tuple[int, ...] = ()

    def tokens(self, text: str, *, first: bool) -> tuple[list[int], list[Span]]:
        """Token ids and character spans of `text`; `first` puts `lead_ids` in front with empty spans (0, 0).

        Raises:
            AlignmentError: the tokenizer gives no character offsets.
        """
        ids, offsets = token_offsets(self.tokenizer, text)
        if first and self.lead_ids:
            ids, offsets = list(self.lead_ids) + ids, [(0, 0)] * len(self.lead_ids) + offsets
        return ids, offsets


@dataclass
class Transcript:
    """One model's rendering of the history so far.

    ids: [n] its tokens; content[t]: (message index, span relative to the message's stripped content) for a
    content token, None for boilerplate; messages[m]: the indices of message m's content tokens, in order.
    """

    name: str
    fmt: ModelFormat
    text: str = ""
    ids: list[int] = field(default_factory=list)
    content: list[tuple[int, Span] | None] = field(default_factory=list)
    messages: dict[int, list[int]] = field(default_factory=dict)
    n_messages: int = 0
    prompted: bool = False  # the text ends with the generation header

    def extend(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> None:
        """Render `messages` (the whole history) and tokenize what is new since the last call, as one block.

        Raises:
            ConfigError: the format renders earlier turns differently once new ones follow (a cache line over the
                earlier render could not be extended).
            AlignmentError: the tokenizer gives no character offsets.
        """
        text = self.fmt.render(list(messages), generation_prompt=generation_prompt)
        if not text.startswith(self.text):
            at = next((i for i, (a, b) in enumerate(zip(text, self.text)) if a != b), min(len(text), len(self.text)))
            raise ConfigError(
                f"{self.name}'s chat format re-renders earlier turns once new ones follow (first difference at "
                f"character {at}: {self.text[at:at + 30]!r} became {text[at:at + 30]!r}); a cache line over the earlier "
                "render cannot be extended. Use a template that only appends (ChatML, the plain User:/Assistant: format)"
            )
        old = len(self.text)
        delta = text[old:]
        if delta:
            ids, offsets = self.fmt.tokens(delta, first=not self.ids)
            offsets = [(s + old, e + old) if e > s else (s, e) for s, e in offsets]
            base = len(self.ids)
            self.ids.extend(ids)
            self.content.extend([None] * len(ids))
            new = list(messages[self.n_messages:])
            for k, span in enumerate(content_spans(delta, new)):
                if span is None:
                    continue
                shifted = (span[0] + old, span[1] + old)
                indices, rel = content_tokens(text, offsets, shifted)
                m = self.n_messages + k
                self.messages[m] = [base + i for i in indices]
                for i, r in zip(indices, rel):
                    self.content[base + i] = (m, r)
        self.text = text
        self.n_messages = len(messages)
        self.prompted = generation_prompt

    def message_tokens(self, m: int) -> tuple[list[int], list[Span]]:
        """Message m's content tokens: (indices into ids, spans relative to the content); empty if none."""
        indices = self.messages.get(m, [])
        return indices, [self.content[i][1] for i in indices]


@dataclass(frozen=True)
class MessageSpan:
    """Messages [start, end) of the history, first read natively by `writer`."""

    start: int
    end: int
    writer: str


@dataclass
class _Written:
    """Translated entries of one message for the receiver: tensors at `point`, per target layer [k, width]."""

    tensors: dict[str, list[torch.Tensor]]
    positions: torch.Tensor  # [k] receiver positions
    origin: str
    hops: int


class CrossConversation:
    """A message history that models with different tokenizers take turns on, each with its own cache line.

    Args:
        models: name → Side (model and layout).
        formats: name → ModelFormat of that model.
        holder: the model that holds the conversation first.
        translators: (from, to) → Translator (or None, the identity, between copies of one model) for every
            ordered pair of distinct names.
        mode: "segment" | "naive" | "reprefill".
        refresh_every: re-prefill a line natively after this many turns with translated content (None: never).
        point: capture point when every translator is the identity (default pre_norm).
        unaligned: "error" (raise the alignment's error) or "prefill" (the receiver reads the message itself).
    Raises:
        ConfigError: unknown mode/holder/unaligned, missing formats or translators, translators at different
            points, refresh_every < 1.
        PairMismatchError: a translator whose maps do not fit its pair.
    """

    def __init__(
        self,
        models: Mapping[str, Side],
        formats: Mapping[str, ModelFormat],
        *,
        holder: str,
        translators: Mapping[tuple[str, str], Translator | None] | None = None,
        mode: str = "segment",
        refresh_every: int | None = None,
        point: str | None = None,
        unaligned: str = "error",
    ):
        self.models = dict(models)
        _check_mode(mode)
        _check_refresh(refresh_every)
        if unaligned not in UNALIGNED:
            raise ConfigError(f"unaligned must be one of {', '.join(UNALIGNED)}, got {unaligned!r}")
        if set(formats) != set(self.models):
            raise ConfigError(f"give one ModelFormat per model: models {sorted(self.models)}, formats {sorted(formats)}")
        self.mode, self.refresh_every, self.unaligned = mode, refresh_every, unaligned
        self.translators = _complete_translators(self.models, translators)
        self.point = _common_point(self.translators, point)
        self.holder = self._name(holder)
        self.messages: list[dict[str, str]] = []
        self.spans: list[MessageSpan] = []
        self.translation_counts: dict[tuple[int, int], int] = {}
        self.fallbacks: list[tuple[int, str, str]] = []  # (message, receiver, why) read natively instead
        self.n_turns = 0
        self.events: list[TurnResult | SwitchRecord] = []
        self.transcripts = {name: Transcript(name, formats[name]) for name in self.models}
        self.lines = {name: CacheLine.empty(s.layout, self.point, s.model.device) for name, s in self.models.items()}
        self.covered_messages = {name: 0 for name in self.models}  # messages each line covers

    # --- Public API -------------------------------------------------------------------------------

    def seen(self, name: str) -> int:
        """How many tokens of `name`'s own transcript its cache line covers."""
        return self.lines[self._name(name)].n_tokens

    def append(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Add messages (e.g. a user turn) to the history; the next holder to generate reads them.

        Raises:
            ConfigError: no messages, or a message without a role or string content.
        """
        if not messages:
            raise ConfigError("nothing to append: give at least one {'role', 'content'} message")
        for message in messages:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ConfigError(f"a message needs a string role and content, got {dict(message)!r}")
        self.messages.extend({"role": m["role"], "content": m["content"]} for m in messages)

    def generate(self, settings: GenerationSettings | None = None) -> TurnResult:
        """The holder reads what its line lacks up to its generation header and answers; the answer's text becomes
        an assistant message, and the holder's line then covers its whole transcript natively.

        Raises:
            ConfigError: empty history, invalid settings, a format with an empty generation header.
            PrefixTooLongError: the transcript plus the budget exceed the holder's positions.
        """
        settings = settings or GenerationSettings()
        settings.check()
        if not self.messages:
            raise ConfigError("the conversation is empty: append the prompt's messages before generating")
        name, side, line = self.holder, self.models[self.holder], self.lines[self.holder]
        script = self.transcripts[name]
        if self.covered_messages[name] != self._written():
            raise ConversationStateError(f"{name} covers {self.covered_messages[name]} messages but "
                                         f"{self._written()} were written")
        script.extend(self.messages, generation_prompt=True)
        start = line.n_tokens
        pending = torch.tensor(script.ids[start:], dtype=torch.long)
        if pending.numel() == 0:
            raise ConfigError(f"{name}'s format adds no generation header after the last message: nothing to read")
        self._check_fits(name, len(script.ids) + settings.max_new_tokens - 1, f"generating {settings.max_new_tokens} tokens")
        with torch.no_grad(), _recording(side) as raw:
            cache = line.to_cache(side)
            t0 = time.perf_counter()
            logits = decode_step(side.model, cache, pending, position=start, logits_to_keep=1)[-1]
            read_s = time.perf_counter() - t0
            decoded = decode_from(side.model, cache, logits, settings, step=positioned_step(start + pending.numel()))
        fed = decoded.token_ids[:-1]  # the last token was not fed back
        answer_start = len(script.ids)
        text = script.fmt.tokenizer.decode(decoded.answer_ids, skip_special_tokens=True).strip()
        first_unwritten = self._written()
        self.messages.append({"role": "assistant", "content": text})
        script.extend(self.messages, generation_prompt=False)
        # The transcript holds the format's tokens of the answer text; what the model fed back is kept as far as it
        # agrees with them, the rest is read natively below.
        own = script.ids[answer_start:]
        keep = next((i for i, (a, b) in enumerate(zip(fed, own)) if a != b), min(len(fed), len(own)))
        rows = _own_objects(side, raw, start, pending.numel() + len(fed), self.point)
        line.append({k: [x[:pending.numel() + keep] for x in xs] for k, xs in rows.items()}, start, origin=name, hops=0)
        t1 = time.perf_counter()
        self._check_fits(name, len(script.ids), "the answer as its format writes it")
        self._extend_line(name, [("prefill", line.n_tokens, len(script.ids))])
        read_s += time.perf_counter() - t1
        self._add_span(MessageSpan(first_unwritten, len(self.messages), name))
        self.covered_messages[name] = len(self.messages)
        self.n_turns += 1
        turn = TurnResult(name, answer_start, decoded.token_ids, text, decoded.stopped, read_s, decoded.decode_s)
        self.events.append(turn)
        return turn

    def switch_to(self, name: str) -> SwitchRecord:
        """Hand the conversation to `name`, bringing its line up to the written messages by the conversation's mode.

        Raises:
            ConfigError: unknown model name; AlignmentError: a message that does not align (unaligned="error").
            PrefixTooLongError: the receiver's rendering exceeds its positions.
        """
        name = self._name(name)
        outgoing = self.holder
        started = time.perf_counter()
        if name == outgoing:
            record = SwitchRecord(outgoing, name, "none", [], 0, 0.0)
        else:
            script = self.transcripts[name]
            script.extend(self.messages[:self._written()], generation_prompt=False)
            self._check_fits(name, len(script.ids), "the written messages")
            record = self._switch(outgoing, name)
            self.covered_messages[name] = self._written()
        record.seconds = time.perf_counter() - started
        self.holder = name
        self.events.append(record)
        return record

    def _switch(self, outgoing: str, name: str) -> SwitchRecord:
        """The strategy of the conversation's mode (or a refresh), without gradients."""
        with torch.no_grad():
            if self._needs_refresh(name):
                record = self._refresh(outgoing, name)
            elif self.mode == "segment":
                record = self._switch_segment(outgoing, name)
            elif self.mode == "naive":
                record = self._switch_naive(outgoing, name)
            else:
                record = self._switch_reprefill(outgoing, name)
        return record

    def max_translation_count(self) -> int:
        """The most times any written span has been translated (1 at most in segment mode with two models)."""
        return max(self.translation_counts.values(), default=0)

    # --- Switch strategies ------------------------------------------------------------------------

    def _switch_segment(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Translate the content of each written message the receiver lacks from its writer's native entries."""
        first, upto = self.covered_messages[incoming], self._written()
        start = self.lines[incoming].n_tokens
        written, done = {}, []
        for span in self.spans:
            lo, hi = max(span.start, first), min(span.end, upto)
            translated = False
            for m in range(lo, hi):
                entry = self._translated_message(span.writer, incoming, m, native=True)
                if entry is not None:
                    written[m] = entry
                    translated = True
            if translated:
                self.translation_counts[(span.start, span.end)] += 1
                done.append((lo, hi))
        n = self._extend_line(incoming, self._runs(incoming, start, written))
        return SwitchRecord(outgoing, incoming, "segment", done, n, 0.0)

    def _switch_naive(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Replace the receiver's line by a translation of the outgoing model's whole line."""
        upto = self._written()
        if self.covered_messages[outgoing] != upto:
            raise ConversationStateError(f"{outgoing} covers {self.covered_messages[outgoing]} of {upto} written messages")
        written = {}
        for m in range(upto):
            entry = self._translated_message(outgoing, incoming, m, native=False)
            if entry is not None:
                written[m] = entry
        side = self.models[incoming]
        previous = self.lines[incoming].translated_since_turn
        self.lines[incoming] = CacheLine.empty(side.layout, self.point, side.model.device)
        self.lines[incoming].translated_since_turn = previous
        n = self._extend_line(incoming, self._runs(incoming, 0, written))
        spans = [(s.start, s.end) for s in self.spans if s.end <= upto]
        for span in spans:
            self.translation_counts[span] += 1
        return SwitchRecord(outgoing, incoming, "naive", spans, n, 0.0)

    def _switch_reprefill(self, outgoing: str, incoming: str) -> SwitchRecord:
        """The receiver reads its missing transcript tokens itself (exact reference)."""
        start, end = self.lines[incoming].n_tokens, len(self.transcripts[incoming].ids)
        self._extend_line(incoming, [("prefill", start, end)])
        return SwitchRecord(outgoing, incoming, "reprefill", [], end - start, 0.0)

    def _refresh(self, outgoing: str, incoming: str) -> SwitchRecord:
        """Rebuild the receiver's line by a native prefill of its whole transcript of the written messages."""
        side = self.models[incoming]
        self.lines[incoming] = CacheLine.empty(side.layout, self.point, side.model.device)
        end = len(self.transcripts[incoming].ids)
        self._extend_line(incoming, [("prefill", 0, end)])
        return SwitchRecord(outgoing, incoming, "refresh", [], end, 0.0)

    def _needs_refresh(self, name: str) -> bool:
        since = self.lines[name].translated_since_turn
        return self.refresh_every is not None and since is not None and self.n_turns - since >= self.refresh_every

    # --- Building a receiver's line -------------------------------------------------------------------

    def _translated_message(self, source: str, receiver: str, m: int, *, native: bool) -> _Written | None:
        """Message m's content entries of `source`'s line, translated for `receiver` and placed at the receiver
        positions their tokens are assigned to; None when either side has no content tokens for it, or (unaligned
        "prefill") when the two tokenizations do not align.

        native: take the writer's own entries only (one per content token), else every entry of the line at the
        source's content positions (a naive switch re-translates translated entries).

        Raises:
            AlignmentError: the two tokenizations of the content do not cover the same characters (unaligned="error").
            ConversationStateError: the source's line does not hold the message (natively, when `native`).
        """
        src_idx, src_rel = self.transcripts[source].message_tokens(m)
        rcv_idx, rcv_rel = self.transcripts[receiver].message_tokens(m)
        if not src_idx or not rcv_idx:
            return None
        content = self.messages[m]["content"].strip()
        try:
            alignment = align(src_rel, rcv_rel, text=content)
        except AlignmentError as err:
            if self.unaligned == "prefill":
                self.fallbacks.append((m, receiver, str(err)))
                return None
            raise AlignmentError(
                f"message {m} ({self.messages[m]['role']}) cannot be aligned between {source} and {receiver}: {err}. "
                "Pass unaligned='prefill' to let the receiver read such messages itself"
            ) from err
        line = self.lines[source]
        position_of = {p: i for i, p in enumerate(src_idx)}  # source token → index among the message's tokens
        entries = [e for e, p in enumerate(line.positions.tolist()) if p in position_of]
        # A message's entries came in one run (or, for the writer's answer, its fed-back tokens then the rest of
        # its turn read natively): one provenance.
        provenance = {(seg.origin, seg.hops) for seg in (_segment_at(line, int(line.positions[e])) for e in entries)}
        if native and (len(entries) != len(src_idx) or provenance != {(source, 0)}):
            raise ConversationStateError(f"{source}'s line does not hold message {m} natively")
        if len(provenance) != 1:
            raise ConversationStateError(f"{source}'s line holds message {m} with mixed provenance {sorted(provenance)}")
        origin, hops = provenance.pop()
        index = torch.tensor(entries, dtype=torch.long)
        rows = {name: [x.index_select(0, index.to(x.device)) for x in xs] for name, xs in line.objects.items()}
        assigned = [rcv_idx[alignment.assigned[position_of[int(line.positions[e])]]] for e in entries]
        # Token identity across tokenizers reads the receiver's ids of the tokens the entries are assigned to.
        receiver_ids = torch.tensor([self.transcripts[receiver].ids[a] for a in assigned], dtype=torch.long)
        translated = translate(self.translators[(source, receiver)], rows, receiver_ids)
        return _Written(translated, torch.tensor(assigned, dtype=torch.long), origin, hops + 1)

    def _runs(self, receiver: str, start: int, written: Mapping[int, _Written]) -> list[tuple]:
        """The receiver's transcript tokens [start, end) as runs in order: ("prefill", lo, hi) for tokens it reads
        itself (boilerplate, messages not translated) and ("written", lo, hi, _Written) for a translated message
        whose content tokens are [lo, hi)."""
        script = self.transcripts[receiver]
        runs: list[tuple] = []
        t, end = start, len(script.ids)
        while t < end:
            owner = script.content[t]
            if owner is not None and owner[0] in written:
                tokens = script.messages[owner[0]]
                lo, hi = tokens[0], tokens[-1] + 1
                if lo != t or hi - lo != len(tokens):
                    raise ConversationStateError(f"{receiver}'s content tokens of message {owner[0]} are not contiguous")
                runs.append(("written", lo, hi, written[owner[0]]))
                t = hi
                continue
            lo = t
            while t < end and not (script.content[t] is not None and script.content[t][0] in written):
                t += 1
            runs.append(("prefill", lo, t))
        return runs

    def _extend_line(self, name: str, runs: Sequence[tuple]) -> int:
        """Apply runs to `name`'s line in order on one engine cache: prefills are read by the model on top of what
        precedes them and recorded (native entries); translated entries are written at their positions. Returns
        the number of transcript tokens covered."""
        side, line, script = self.models[name], self.lines[name], self.transcripts[name]
        runs = [run for run in runs if run[2] > run[1]]
        if not runs:
            return 0
        first = line.n_tokens
        with torch.no_grad():
            cache = line.to_cache(side)
            for run in runs:
                if run[0] == "prefill":
                    _, lo, hi = run
                    with _recording(side) as raw:
                        prefill_run(side.model, cache, torch.tensor(script.ids[lo:hi], dtype=torch.long), lo)
                    line.append(_own_objects(side, raw, lo, hi - lo, self.point), lo, origin=name, hops=0)
                else:
                    _, lo, hi, entry = run
                    write_run(side.model, side.layout, cache, entry.tensors, entry.positions, self.point)
                    line.append(entry.tensors, lo, origin=entry.origin, hops=entry.hops, positions=entry.positions, end=hi)
                    if line.translated_since_turn is None:
                        line.translated_since_turn = self.n_turns
        return line.n_tokens - first

    # --- Helpers ----------------------------------------------------------------------------------

    def _written(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def _add_span(self, span: MessageSpan) -> None:
        self.spans.append(span)
        self.translation_counts[(span.start, span.end)] = 0

    def _check_fits(self, name: str, n_positions: int, what: str) -> None:
        limit = self.models[name].layout.max_positions
        if n_positions > limit:
            raise PrefixTooLongError(
                f"{what} needs {n_positions} positions of {name}, which reads at most {limit}; start a new "
                "conversation or generate fewer tokens"
            )

    def _name(self, name: str) -> str:
        return _model_name(self.models, name)


def _segment_at(line: CacheLine, position: int):
    """The line segment whose token span holds `position` (segments are disjoint)."""
    for seg in line.segments:
        if seg.start <= position < seg.end:
            return seg
    raise ConversationStateError(f"no segment of the line covers position {position}")
