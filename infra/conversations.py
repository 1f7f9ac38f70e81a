"""Conversation sources: where the (prefix, continuation) training samples come from.

:func:`load_conversations` turns a *source* string into a :class:`Corpus`:

* ``"embedded"`` / ``"embedded:N"`` -- the synthetic multi-turn chats of :mod:`infra.synthetic_chat`
  (400 by default). No files, no network.
* a local file -- ``.jsonl``, ``.jsonl.gz``, ``.json`` or ``.json.gz`` holding one of these record shapes:

  - ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / HF chat style);
  - ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`` (ShareGPT style);
  - ``{"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ..."}`` (Anthropic hh-rlhf transcripts);
  - ``{"question": "...", "answer": "..."}`` (single-turn Q&A files such as GSM8K's): the question as the user
    turn, the answer as the assistant turn;
  - ``{"text": "..."}`` -- plain text. A ``.json`` file may also be one such object (RULER's
    ``PaulGrahamEssays.json``). Long texts are cut into documents of about ``text_chunk_chars``
    characters at blank lines, so that many windows can be drawn from a single essay collection.

* a list of such sources -- a mixture: their items interleaved one from each source in turn (so every
  prefix of the mixture, and so any ``limit``, holds each source about equally), until ``limit`` items. The sources
  must all be chat or all plain text. Fitting on chat alone leaves rare tokens such as digits badly translated;
  mixing in a numeric Q&A file (GSM8K), with more source layers per map, took SmolLM2 → Gemma-3's share of a copied
  code's log-prob gap from 0.26 to 0.54 (README, "Cross-tokenizer pairs").
* a Hugging Face dataset id ``org/name`` with an optional ``:split`` -- for example
  ``nvidia/Nemotron-SFT-Instruction-Following-Chat-v2`` -- loaded with ``datasets.load_dataset``.
  With ``HF_DATASETS_OFFLINE=1`` (the platform default) only a dataset already in the local cache loads.

A chat conversation is kept only if it has at least one assistant turn with non-empty content: without
one there is nothing to continue. Dropped conversations are counted in :attr:`Corpus.dropped`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from translators.errors import ConfigError

log = logging.getLogger(__name__)

Conversation = list[dict]
"""A chat: ``[{"role": "user"|"assistant"|"system", "content": str}, ...]``."""

DEFAULT_HUB_DATASET = "nvidia/Nemotron-SFT-Instruction-Following-Chat-v2"
DEFAULT_EMBEDDED_COUNT = 400
DEFAULT_TEXT_CHUNK_CHARS = 8000

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}
_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
_SUPPORTED_SHAPES = ('{"messages": [{"role", "content"}, ...]}', '{"conversations": [{"from", "value"}, ...]}',
                     '{"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ..."}', '{"question": ..., "answer": ...}',
                     '{"text": "..."}')
# `org/name` (hub naming rules: letters, digits, '-', '_', '.'), optionally `:split`.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<split>[\w.-]+))?$")
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass(frozen=True)
class TextDocument:
    """One plain-text document of a text corpus."""

    text: str


@dataclass(frozen=True)
class Corpus:
    """What a source yielded.

    Attributes:
        kind: ``"chat"`` (items are :data:`Conversation` lists) or ``"text"`` (items are
            :class:`TextDocument`).
        items: the conversations or documents, in source order.
        name: the source it came from (for logs); for a mixture its sources joined by " + ".
        source: what reloads it with :func:`load_conversations`: the source string, or the list of a mixture.
        dropped: chat conversations left out because they had no non-empty assistant turn (or an
            unknown role); always 0 for text.
    """

    kind: str
    items: tuple
    name: str
    dropped: int = 0
    source: str | list[str] | None = None

    def __post_init__(self) -> None:
        if self.source is None:
            object.__setattr__(self, "source", self.name)

    def __len__(self) -> int:
        return len(self.items)


# --- Entry point --------------------------------------------------------------------------------


def load_conversations(source: str | list[str], *, limit: int | None = None, seed: int = 0,
                       text_chunk_chars: int = DEFAULT_TEXT_CHUNK_CHARS) -> Corpus:
    """Load a conversation or text corpus from ``source`` (see the module docstring for the forms).

    Args:
        source: ``"embedded"``, ``"embedded:N"``, a local file path, a hub id ``org/name[:split]``, or a list of
            these (a mixture).
        limit: keep at most this many items (the first ones, in source order); ``None`` keeps all.
        seed: seed of the embedded generator (files and hub datasets are read in order, so it does
            not affect them).
        text_chunk_chars: target size of the documents a long plain text is cut into.

    Returns:
        A :class:`Corpus` with at least one item.

    Raises:
        ConfigError: unknown source, missing file, unsupported record shape, hub dataset not
            available offline, bad ``limit``/``text_chunk_chars``, nothing usable in the source, or a mixture
            of chat and plain-text sources.
    """
    _check_positive("limit", limit, allow_none=True)
    _check_positive("text_chunk_chars", text_chunk_chars)
    if isinstance(source, (list, tuple)):
        return _mixture(list(source), limit, seed, text_chunk_chars)
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"conversation source must be a non-empty string, got {source!r}; use 'embedded', "
                          f"a .jsonl/.json(.gz) file, or a hub dataset id such as {DEFAULT_HUB_DATASET!r}")
    source = source.strip()
    if source == "embedded" or source.startswith("embedded:"):
        corpus = _embedded(source, limit, seed)
    else:
        path = Path(source).expanduser()
        if path.is_file():
            corpus = _from_records(_read_records(path), source, limit, text_chunk_chars)
        elif source.endswith(_FILE_SUFFIXES) or path.is_dir():
            raise ConfigError(f"conversation file not found: looked for {str(path.resolve())!r}"
                              + (" (that is a directory)" if path.is_dir() else "")
                              + "; pass an existing .jsonl/.jsonl.gz/.json/.json.gz file")
        elif _HUB_ID.match(source):
            corpus = _from_hub(source, limit, text_chunk_chars)
        else:
            raise ConfigError(f"unknown conversation source {source!r}: not 'embedded[:N]', not an existing file "
                              f"(looked for {str(path.resolve())!r}), and not a hub id 'org/name[:split]'")
    if not corpus.items:
        raise ConfigError(f"empty dataset: {source!r} yielded no usable {corpus.kind} items"
                          + (f" ({corpus.dropped} conversations dropped: no assistant turn with content "
                             f"or an unknown role)" if corpus.dropped else ""))
    if corpus.dropped:
        log.warning("%s: dropped %d conversations without a non-empty assistant turn (or with an unknown role)",
                    source, corpus.dropped)
    return corpus


def check_source(source: str | list[str]) -> None:
    """Cheap pre-flight check of a source's form (no reading): embedded, an existing file, or a hub id; for a
    mixture, each of its sources.

    Raises:
        ConfigError: the same messages `load_conversations` gives for a malformed or missing source (for a mixture,
            every bad source at once).
    """
    if isinstance(source, (list, tuple)):
        problems = [problem] if (problem := mixture_problem(list(source))) else []
        for part in source:
            try:
                check_source(part)
            except ConfigError as err:
                problems.append(str(err))
        if problems:
            raise ConfigError("; ".join(problems))
        return
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"conversation source must be a non-empty string, got {source!r}")
    source = source.strip()
    if source == "embedded" or source.startswith("embedded:"):
        return
    path = Path(source).expanduser()
    if path.is_file() or (_HUB_ID.match(source) and not source.endswith(_FILE_SUFFIXES)):
        return
    raise ConfigError(f"conversation source {source!r} is not 'embedded[:N]', not an existing file "
                      f"(looked for {str(path.resolve())!r}) and not a hub id 'org/name[:split]'")


def _check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Reject non-integers and values < 1 (``None`` too unless ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")


# --- Mixtures -----------------------------------------------------------------------------------


def mixture_problem(sources: list) -> str | None:
    """Why a list is not a mixture (fewer than two sources, or one named twice), or None."""
    if len(sources) < 2:
        return f"a mixture needs at least two sources, got {sources!r}; pass a single source as a string"
    repeated = sorted({s for s in sources if sources.count(s) > 1}, key=str)
    if repeated:
        return f"a mixture names {', '.join(map(repr, repeated))} more than once; name each source once"
    return None


def _mixture(sources: list, limit: int | None, seed: int, text_chunk_chars: int) -> Corpus:
    """Each source loaded (up to ``limit`` items), then interleaved one item per source in turn until ``limit``.

    Round-robin rather than a random draw: the first n items of the mixture are the same whatever ``limit`` is, so
    a larger fit extends a smaller one's data instead of redrawing it.

    Raises:
        ConfigError: not a list of at least two distinct sources, a source's own error (naming the source), or
            chat and plain-text sources mixed.
    """
    problem = mixture_problem(sources)
    if problem:
        raise ConfigError(problem)
    parts = [load_conversations(part, limit=limit, seed=seed, text_chunk_chars=text_chunk_chars) for part in sources]
    kinds = {part.kind for part in parts}
    if len(kinds) > 1:
        raise ConfigError("a mixture must be all chat or all plain text: "
                          + ", ".join(f"{part.name!r} is {part.kind}" for part in parts))
    items = []
    for index in range(max(len(part) for part in parts)):
        items.extend(part.items[index] for part in parts if index < len(part))
    items = items[:limit] if limit is not None else items
    return Corpus(kind=parts[0].kind, items=tuple(items), name=" + ".join(part.name for part in parts),
                  dropped=sum(part.dropped for part in parts), source=[part.name for part in parts])


# --- Embedded -----------------------------------------------------------------------------------


def _embedded(source: str, limit: int | None, seed: int) -> Corpus:
    """The synthetic chats; ``embedded:N`` asks for N of them."""
    from infra.synthetic_chat import generate_conversations

    count = DEFAULT_EMBEDDED_COUNT
    if source != "embedded":
        text = source.removeprefix("embedded:")
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"bad source {source!r}: write 'embedded' or 'embedded:N' with N a positive integer")
        count = int(text)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    if limit is not None:
        count = min(count, limit)
    return _chat_corpus(generate_conversations(count, seed), source, limit)


# --- Files --------------------------------------------------------------------------------------


def _read_records(path: Path) -> Iterator[Any]:
    """Yield the records of a JSON Lines or JSON file (gzip-compressed or not).

    Raises:
        ConfigError: unsupported suffix or invalid JSON (with the line number for JSON Lines).
    """
    name = path.name.lower()
    if not name.endswith(_FILE_SUFFIXES):
        raise ConfigError(f"unsupported conversation file {str(path)!r}: expected one of {', '.join(_FILE_SUFFIXES)}")
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        if name.endswith((".jsonl", ".jsonl.gz")):
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
            return
        try:
            data = json.load(handle)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    # A .json file is either a list of records or one record (e.g. {"text": "..."}).
    yield from data if isinstance(data, list) else [data]


def _record_shape(record: Any) -> str:
    """Which supported shape a record has: ``messages``, ``conversations``, ``chosen`` or ``text``.

    Raises:
        ConfigError: naming the keys found and the supported shapes.
    """
    if isinstance(record, dict):
        for key in ("messages", "conversations", "chosen", "text"):
            if key in record:
                return key
        if "question" in record and "answer" in record:
            return "question"
        found = f"keys {sorted(record)!r}"
    else:
        found = f"a JSON {type(record).__name__}, not an object"
    raise ConfigError(f"unknown record shape: found {found}; supported shapes: " + "; ".join(_SUPPORTED_SHAPES))


def _from_records(records: Iterable[Any], name: str, limit: int | None, text_chunk_chars: int) -> Corpus:
    """Parse records whose shape is fixed by the first one; stop once ``limit`` items are kept."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        return Corpus(kind="chat", items=(), name=name)
    shape = _record_shape(first)
    everything = _chain(first, records)
    if shape == "text":
        return _text_corpus((_field(r, "text", i) for i, r in enumerate(everything)), name, limit, text_chunk_chars)
    if shape == "question":
        return _chat_corpus((_parse_qa(_field(r, "question", i), _field(r, "answer", i)) for i, r in enumerate(everything)),
                            name, limit)
    parse = {"messages": _parse_messages, "conversations": _parse_sharegpt, "chosen": _parse_hh}[shape]
    return _chat_corpus((parse(_field(r, shape, i)) for i, r in enumerate(everything)), name, limit)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    """``first`` followed by ``rest``."""
    yield first
    yield from rest


def _field(record: Any, key: str, index: int) -> Any:
    """``record[key]``, or a ConfigError when a later record has another shape than the first."""
    if not isinstance(record, dict) or key not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"record {index} has no {key!r} field (found {found!r}) although the first record did; "
                          f"all records of a source must share one shape")
    return record[key]


# --- Record parsers (None = drop the conversation) ----------------------------------------------


def _parse_messages(messages: Any) -> Conversation | None:
    """``[{"role", "content"}, ...]`` -> conversation; None for unknown roles or malformed turns."""
    if not isinstance(messages, list):
        return None
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = _content_text(message.get("content"))
        if message.get("role") not in ROLES or content is None:
            return None
        turns.append({"role": message["role"], "content": content})
    return turns


def _parse_sharegpt(turns: Any) -> Conversation | None:
    """ShareGPT ``[{"from", "value"}, ...]``: human -> user, gpt -> assistant."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None
    return _parse_messages([{"role": _SHAREGPT_ROLES.get(str(t.get("from")).lower()), "content": t.get("value")}
                            for t in turns])


def _parse_qa(question: Any, answer: Any) -> Conversation | None:
    """A single-turn Q&A record -> [user question, assistant answer]; None unless both are strings."""
    if not isinstance(question, str) or not isinstance(answer, str):
        return None
    return [{"role": "user", "content": question.strip()}, {"role": "assistant", "content": answer.strip()}]


def _parse_hh(transcript: Any) -> Conversation | None:
    """An hh-rlhf ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` transcript -> conversation.

    Consecutive turns of one speaker (a few transcripts have them) are merged, since several chat
    templates reject non-alternating roles.
    """
    if not isinstance(transcript, str):
        return None
    pieces = _HH_TURN.split(transcript)
    # pieces = [preamble, speaker, text, speaker, text, ...]; the preamble is empty in hh-rlhf.
    turns: Conversation = []
    for speaker, text in zip(pieces[1::2], pieces[2::2]):
        role = "user" if speaker == "Human" else "assistant"
        text = text.strip()
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] = f"{turns[-1]['content']}\n\n{text}".strip()
        else:
            turns.append({"role": role, "content": text})
    return turns


def _content_text(content: Any) -> str | None:
    """Message content as a string: plain strings, or the text parts of a multi-part content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def _usable(conversation: Conversation | None) -> bool:
    """A conversation needs an assistant turn with non-empty content: that is what gets continued."""
    return bool(conversation) and any(m["role"] == "assistant" and m["content"].strip() for m in conversation)


def _chat_corpus(conversations: Iterable[Conversation | None], name: str, limit: int | None) -> Corpus:
    """Keep usable conversations (up to ``limit``), counting the rest."""
    kept, dropped = [], 0
    for conversation in conversations:
        if limit is not None and len(kept) >= limit:
            break
        if _usable(conversation):
            kept.append(conversation)
        else:
            dropped += 1
    return Corpus(kind="chat", items=tuple(kept), name=name, dropped=dropped)


# --- Plain text ---------------------------------------------------------------------------------


def split_text(text: str, chunk_chars: int = DEFAULT_TEXT_CHUNK_CHARS) -> list[str]:
    """Cut a long text into documents of roughly ``chunk_chars`` characters.

    Paragraphs (separated by blank lines) are grouped until a group reaches ``chunk_chars``; a
    paragraph longer than twice that is first cut at line breaks (or, without any, at spaces), so
    texts with few blank lines still give many documents. Whitespace-only pieces are dropped.

    Returns:
        The documents, in text order (possibly empty).
    """
    pieces: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        pieces.extend(_cut_long(paragraph.strip(), 2 * chunk_chars, chunk_chars))
    documents, group = [], ""
    for piece in pieces:
        if not piece:
            continue
        group = f"{group}\n\n{piece}" if group else piece
        if len(group) >= chunk_chars:
            documents.append(group)
            group = ""
    if group:
        documents.append(group)
    return documents


def _cut_long(paragraph: str, max_chars: int, chunk_chars: int) -> list[str]:
    """Cut a paragraph over ``max_chars`` into ~``chunk_chars`` parts at line breaks or spaces."""
    if len(paragraph) <= max_chars:
        return [paragraph]
    separator = "\n" if "\n" in paragraph else " "
    parts, current = [], ""
    for unit in paragraph.split(separator):
        current = f"{current}{separator}{unit}" if current else unit
        if len(current) >= chunk_chars:
            parts.append(current)
            current = ""
    if current:
        parts.append(current)
    return parts


def _text_corpus(texts: Iterable[Any], name: str, limit: int | None, chunk_chars: int) -> Corpus:
    """Documents from the records' ``text`` fields (up to ``limit`` documents)."""
    documents: list[TextDocument] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"record {index}: 'text' must be a string, got {type(text).__name__}")
        for chunk in split_text(text, chunk_chars):
            if limit is not None and len(documents) >= limit:
                return Corpus(kind="text", items=tuple(documents), name=name)
            documents.append(TextDocument(chunk))
    return Corpus(kind="text", items=tuple(documents), name=name)


# --- Hugging Face hub ---------------------------------------------------------------------------


def _offline() -> bool:
    """Whether the datasets library is told to stay offline (the platform default)."""
    return os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hf_home() -> Path:
    """The Hugging Face cache root, resolved from the environment at call time."""
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface"


def _cached_locations(repo: str) -> list[Path]:
    """Where a downloaded copy of the hub dataset ``repo`` would be (hub cache, datasets cache)."""
    org, name = repo.split("/", 1)
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    hub_cache = Path(hub).expanduser() if hub else _hf_home() / "hub"
    datasets_env = os.environ.get("HF_DATASETS_CACHE")
    datasets_cache = Path(datasets_env).expanduser() if datasets_env else _hf_home() / "datasets"
    return [hub_cache / f"datasets--{org}--{name}", datasets_cache / f"{org}___{name}"]


def _from_hub(source: str, limit: int | None, text_chunk_chars: int) -> Corpus:
    """Load ``org/name[:split]`` with ``datasets.load_dataset``.

    Raises:
        ConfigError: offline without a cached copy, datasets not installed, the load failing, or no
            split given while the dataset has several and none is called ``train``.
    """
    match = _HUB_ID.match(source)
    repo, split = match["repo"], match["split"]
    how = ("either allow downloads (export HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0, then run once with network "
           "access to fill the cache) or pass a local .jsonl/.json(.gz) file")
    if _offline() and not any(p.is_dir() for p in _cached_locations(repo)):
        looked = ", ".join(str(p) for p in _cached_locations(repo))
        raise ConfigError(f"hub dataset {repo!r} is not in the local cache and HF_DATASETS_OFFLINE=1 "
                          f"(looked in {looked}; no local file {source!r} exists either); {how}")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"loading hub dataset {repo!r} needs the 'datasets' package (pip install datasets); "
                          f"or pass a local .jsonl/.json(.gz) file") from None
    try:
        loaded = datasets.load_dataset(repo, split=split)
    except Exception as err:  # noqa: BLE001 -- network, cache and split errors all need the same advice
        raise ConfigError(f"could not load hub dataset {source!r}: {type(err).__name__}: {err}; {how}") from err
    if split is None:
        loaded = _pick_split(loaded, repo)
    return _from_records(loaded, source, limit, text_chunk_chars)


def _pick_split(dataset_dict: Any, repo: str) -> Any:
    """``train`` if present, else the only split; several splits without ``train`` need ``:split``."""
    names = list(dataset_dict.keys())
    if "train" in names:
        return dataset_dict["train"]
    if len(names) == 1:
        return dataset_dict[names[0]]
    raise ConfigError(f"hub dataset {repo!r} has splits {names!r} and none is 'train'; "
                      f"name one as '{repo}:<split>', e.g. '{repo}:{names[0]}'")
