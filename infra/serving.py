"""The engine-independent half of serving translators: saved conversations, the served translator, the gate.

`infra.vllm_connector` (which needs vLLM and runs in the serving venv, `bash infra/bootstrap.sh --serve`) moves
K/V between vLLM's paged cache and these pieces; everything here is plain torch + translators/ so the unit tier
tests it without vLLM.

A saved conversation is one safetensors file per conversation key: per source layer `keys_<l>` (post_norm: the
engine's post-RoPE keys rotated back at their known positions) and `values_<l>`, both [n_tokens, n_kv_heads *
head_dim], plus a JSON header with the token ids, the source model's signature (`infra.zoo.model_signature`)
and, when the engine started that prompt from another conversation, which one and how many tokens it loaded.

Segment-wise hand-off across engines: when a conversation returns to a model, the rows it held before are reused
from its own saved conversation (no translation: its own keys, re-rotated at the same positions) and only the span
the other model wrote since is translated. A producer saves a request's prompt, so the next engine computes the
previous answer's K/V itself as part of the new span.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save

from translators.artifact import check_signature, load_translator, replace_file
from translators.errors import ConfigError, KvlingoError, PairMismatchError
from translators.layout import CacheLayout, cache_layout, decoder_of
from translators.quality import quality_verdict
from translators.switch import identity_translator
from translators.translator import TOKEN_EMBEDDING, Translator

APPLIED, FALLBACK, UNSUPPORTED = "applied", "fallback_reprefill", "unsupported"
STATUSES = (APPLIED, FALLBACK, UNSUPPORTED)
CONVERSATION_FORMAT = "kvlingo.conversation.v1"
SAVED_POINT = "post_norm"  # what a producer stores: keys after k-norm, before RoPE
_KEY = re.compile(r"^[0-9a-f]{32}$")


class ServingError(KvlingoError):
    """A serving configuration or a saved conversation that cannot be used (the message says why)."""


def new_conversation_key() -> str:
    """A fresh conversation key: 32 lowercase hex digits (safe as a file name)."""
    return uuid.uuid4().hex


def check_conversation_key(key: Any) -> str:
    """Raises ServingError for anything but 32 lowercase hex digits (keys name files: no paths)."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ServingError(f"malformed conversation key {key!r}: expected the 32 hex digits a producer returned")
    return key


class ConversationStore:
    """Saved source conversations in a directory shared by the producer and consumer engines."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{check_conversation_key(key)}.safetensors"

    def save(self, key: str, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: list[int],
             source: dict[str, Any], loaded: dict[str, Any] | None = None) -> Path:
        """Write one conversation atomically (a reader never sees half a file).

        Args:
            keys, values: per source layer [n_tokens, n_kv_heads * head_dim]; keys at post_norm.
            token_ids: the n_tokens token ids they were computed for.
            source: the source model's signature.
            loaded: {"conversation": key, "tokens": n} when the first n rows were loaded from that conversation
                (translated or reused) rather than computed from the prompt by this model; None otherwise.
        Raises:
            ServingError: lengths that disagree.
        """
        n = len(token_ids)
        if len(keys) != len(values) or any(t.shape[0] != n for t in (*keys, *values)):
            raise ServingError(f"conversation {key}: {len(keys)} key and {len(values)} value layers, each must hold "
                               f"{n} tokens")
        tensors = {f"keys_{i}": k.contiguous() for i, k in enumerate(keys)}
        tensors |= {f"values_{i}": v.contiguous() for i, v in enumerate(values)}
        header = {"format": CONVERSATION_FORMAT, "point": SAVED_POINT, "token_ids": list(map(int, token_ids)),
                  "n_layers": len(keys), "source": source, "loaded": loaded}
        data = save(tensors, metadata={"kvlingo": json.dumps(header)})
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        replace_file(path, data)
        return path

    def header(self, key: str) -> dict[str, Any] | None:
        """The conversation's header (format, point, token_ids, n_layers, source), None if it is not stored.

        Raises:
            ServingError: a malformed key, or a file that is not a kvlingo conversation.
        """
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {})["kvlingo"])
        except (KeyError, json.JSONDecodeError, OSError, Exception) as err:
            raise ServingError(f"{path} is not a kvlingo conversation: {err}") from err
        if header.get("format") != CONVERSATION_FORMAT:
            raise ServingError(f"{path}: unknown conversation format {header.get('format')!r}")
        return header

    def load(self, key: str, layers: list[int], start: int, end: int) -> dict[str, dict[int, torch.Tensor]]:
        """Rows [start, end) of the given source layers: {"keys": {l: [end-start, width]}, "values": {...}}.

        Raises:
            ServingError: the conversation is gone or holds fewer tokens or layers.
        """
        path = self.path(key)
        if not path.is_file():
            raise ServingError(f"conversation {key} is not in {self.directory}")
        out: dict[str, dict[int, torch.Tensor]] = {"keys": {}, "values": {}}
        with safe_open(str(path), framework="pt") as f:
            for name in out:
                for layer in layers:
                    t = f.get_slice(f"{name}_{layer}")
                    if t.get_shape()[0] < end:
                        raise ServingError(f"conversation {key} holds {t.get_shape()[0]} tokens, not {end}")
                    out[name][layer] = t[start:end]
        return out


def model_skeleton(directory: str | Path) -> tuple[torch.nn.Module, CacheLayout]:
    """The parts of a model the cache points need, without its weights: rotary embedding and key norms.

    The model is built on the meta device from `directory`'s config.json; its rotary embedding is rebuilt on
    the CPU and its per-head key norms (Qwen3, Gemma-3) are read from the safetensors files, so
    `translators.points` applies the model's own k-norm and RoPE. Other parameters stay on the meta device.

    Raises:
        ServingError: no config.json, or a key norm whose weight is missing from the safetensors files.
        UnsupportedModelError: an architecture capture/injection does not support.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ServingError(f"{directory} holds no config.json: serve a local model directory")
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = decoder_of(model)
    rotary = decoder.rotary_emb
    decoder.rotary_emb = type(rotary)(config=rotary.config)  # on the CPU: its inv_freq buffer is computed here
    _load_weights(directory, {name: module for name, module in model.named_modules() if name.endswith("k_norm")},
                  "key-norm")
    model.eval().requires_grad_(False)
    return model, cache_layout(model)


def _load_weights(directory: Path, wanted: dict[str, torch.nn.Module], what: str) -> None:
    """Give each module of `wanted` (module path → module) its weight from the directory's safetensors files, fp32.

    Raises:
        ServingError: a weight not found in the files.
    """
    if not wanted:
        return
    found: dict[str, torch.Tensor] = {}
    for weights in sorted(directory.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():  # save_pretrained names: "<module path>.weight"
                if name.removesuffix(".weight") in wanted:
                    found[name.removesuffix(".weight")] = f.get_tensor(name)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ServingError(f"{directory}: {what} weights {missing[:3]} not found in its safetensors files")
    for name, module in wanted.items():
        module.weight = torch.nn.Parameter(found[name].to(torch.float32), requires_grad=False)


def attach_prompt_token_identity(served: ServedTranslator, model: torch.nn.Module, directory: str | Path) -> None:
    """Let a served translator that appends token identity read the prompt's ids (no-op for any other).

    The engine knows the ids of the rows it translates (the prompt shares them with the saved conversation), so
    both variants are served from those ids: for `codebook` they are the ids the codebook decodes wherever it is
    exact (the fit reports `codebook_accuracy`). The target's input embedding is read from the engine's model
    directory into `model` (the skeleton), [vocab, d_model] fp32. Only plain `nn.Embedding` inputs are read this
    way; a scaled one (Gemma-3) leaves the translator without its module and the gate answers unsupported.

    Raises:
        ServingError: the embedding weight is not in the directory's safetensors files.
    """
    from translators.token_identity import TokenIdentity

    translator = served.translator
    embedding = model.get_input_embeddings()
    if translator.token_identity is None or type(embedding) is not torch.nn.Embedding:
        return
    name = next(path for path, module in model.named_modules() if module is embedding)
    _load_weights(Path(directory), {name: embedding}, "input-embedding")
    translator.token_module = TokenIdentity("ids", embedding.weight.detach(), None)


@dataclass(frozen=True)
class ServedTranslator:
    """What a consumer engine serves: the maps plus what the gate checks before loading.

    `ref` is "identity" (the target reads its own model's cache: source and target must be the same model) or
    the path of a translator artifact (`models:/NAME@ALIAS` is resolved to a path by the CLI, where the
    registry lives). `envelope` is the longest prefix, in tokens, the translator is served for: the fit's
    max_prefix_tokens, capped by the engine's `max_prefix_tokens` setting; None: no limit below the model's.
    `quality` is the artifact's recorded quality (manifest fit.quality, `translators.quality`): per prefix-length
    bucket, how faithfully the target reads the translated cache, and the calibrated floor the gate holds it to;
    None for identity (exact) and for artifacts fitted before quality records existed.
    """

    ref: str
    translator: Translator
    identity: str  # what isolates its results in the prefix cache: "identity" or the weights' sha256
    source: dict[str, Any] | None  # the source signature the artifact records (identity: the target's own)
    envelope: int | None
    target: dict[str, Any]  # the signature of the model this engine serves (its own saved conversations carry it)
    quality: dict[str, Any] | None = None


def serve_translator(ref: str, target_layout: CacheLayout, target_signature: dict[str, Any],
                     max_prefix_tokens: int | None = None) -> ServedTranslator:
    """Resolve a translator reference for a consumer engine serving the model of `target_signature`.

    Raises:
        ServingError: `models:/` references (resolve them first), a missing artifact, or a bad envelope.
        PairMismatchError: an artifact fitted for another target model (the field is named).
        ArtifactError: a tampered or incomplete artifact.
    """
    if max_prefix_tokens is not None and (not isinstance(max_prefix_tokens, int) or max_prefix_tokens < 1):
        raise ServingError(f"max_prefix_tokens must be a positive integer, got {max_prefix_tokens!r}")
    if ref == "identity":
        return ServedTranslator(ref, identity_translator(target_layout, SAVED_POINT), "identity", target_signature,
                                max_prefix_tokens, target_signature)
    if ref.startswith("models:/"):
        raise ServingError(f"{ref}: resolve registry references to an artifact path before starting the engine "
                           "(`kvlingo serve` does; the connector imports no MLflow)")
    if not Path(ref).is_dir():
        raise ServingError(f"translator {ref!r} is neither 'identity' nor an artifact directory")
    translator, manifest = load_translator(ref, target=target_signature)
    fitted = (manifest.get("fit") or {}).get("config", {}).get("max_prefix_tokens")
    limits = [n for n in (fitted, max_prefix_tokens) if isinstance(n, int)]
    return ServedTranslator(ref, translator, manifest["weights_sha256"], manifest["pair"]["source"],
                            min(limits) if limits else None, target_signature,
                            (manifest.get("fit") or {}).get("quality"))


@dataclass(frozen=True)
class Decision:
    """The gate's verdict for one request: a status, why, and which prefix rows come from where.

    Applied: rows [0, reused) are this model's own, from its saved conversation `own`; rows [reused, n_load) are
    translated from the named source conversation.
    """

    status: str
    reason: str
    n_load: int = 0
    reused: int = 0
    own: str | None = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def gate(served: ServedTranslator, header_of: Callable[[str], dict[str, Any] | None], prompt: list[int],
         conversation: str) -> Decision:
    """Decide, before loading anything, whether a request that names a source conversation is served from it.

    Args:
        header_of: a saved conversation's header by key, None if it is not stored (`ConversationStore.header`).
    Returns:
        applied: load the first n_load tokens (the common prefix of the saved tokens and the prompt, leaving the
        prompt's last token for the engine). If the source conversation itself started from a conversation this
        model saved (the conversation returns to it), that conversation's rows are reused and only the rest is
        translated. fallback_reprefill: the engine prefills as if no conversation was named (missing
        conversation, pair mismatch, prefix over the envelope, nothing in common, a recorded quality below the
        translator's calibrated floor for a prefix of that length or no quality measured at that length, a source
        whose prefix was translated from a third model's conversation). unsupported: what this connector cannot serve exactly
        (the reason says what to change).
    Raises:
        ServingError: from `header_of`, for a malformed key or a file that is not a conversation.
    """
    header = header_of(conversation)
    if header is None:
        return Decision(FALLBACK, f"source conversation {conversation} is not in the store")
    source = header.get("source")
    if not isinstance(source, dict):
        return Decision(FALLBACK, f"source conversation {conversation} records no source model signature")
    try:
        check_signature(served.source, source, "source")
    except PairMismatchError as err:
        return Decision(FALLBACK, str(err))
    translator = served.translator
    layers = source.get("layout", {}).get("layers", [])
    if translator.point == "pre_norm" and any(layer.get("k_norm") for layer in layers):
        return Decision(UNSUPPORTED, "the translator acts at pre_norm but the source model normalises its keys: the "
                                     "engine's keys cannot be taken back before the norm; refit it at post_norm")
    if translator.point == "post_rope":
        return Decision(UNSUPPORTED, "translators fitted at post_rope are not served (the connector stores keys "
                                     "at post_norm); refit it at post_norm")
    reads = {name: tuple(o for o in translator.inputs[name] if o != TOKEN_EMBEDDING) for name in translator.objects}
    if set(translator.objects) != {"keys", "values"} or any(reads[name] != (name,) for name in reads):
        return Decision(UNSUPPORTED, "only GQA → GQA translators (keys and values) are served")
    if translator.token_identity is not None and translator.token_module is None:
        return Decision(UNSUPPORTED, "the translator appends token identity, read here from the target's input "
                                     "embedding, and this model's is not a plain embedding table (a scaled one, as "
                                     "Gemma-3's, is not served yet); refit it with token_identity none")
    n_load = min(_common_prefix(header.get("token_ids") or [], prompt), len(prompt) - 1)
    if n_load < 1:
        return Decision(FALLBACK, f"the prompt shares no prefix with source conversation {conversation}")
    if served.envelope is not None and n_load > served.envelope:
        return Decision(FALLBACK, f"the prefix of {n_load} tokens exceeds the translator's envelope of "
                                  f"{served.envelope} tokens")
    # The floor was calibrated on whole translated prefixes of n_load tokens; a returning conversation translates
    # fewer (its own rows are reused), so holding it to the same bucket is conservative.
    below_floor = quality_verdict(served.quality, n_load)
    if below_floor is not None:
        return Decision(FALLBACK, below_floor)
    reused, own = _own_rows(served, header_of, header, prompt, n_load)
    if isinstance(own, Decision):
        return own
    reason = f"{n_load} of {len(prompt)} prompt tokens loaded: "
    if reused:
        reason += f"{reused} reused from this model's conversation {own}, "
    reason += f"{n_load - reused} translated from conversation {conversation}"
    return Decision(APPLIED, reason, n_load, reused, own)


def _own_rows(served: ServedTranslator, header_of: Callable[[str], dict[str, Any] | None], header: dict[str, Any],
              prompt: list[int], n_load: int) -> tuple[int, str | None | Decision]:
    """How many leading rows the engine reuses from its own saved conversation, and which one.

    A source conversation whose first rows were loaded (not computed by the source model from the prompt) names
    where they came from. If that is a conversation of this engine's model holding the same tokens, those rows
    are reused untranslated; otherwise they are a translation and are not translated again (fallback).
    """
    loaded = header.get("loaded")
    if not loaded:
        return 0, None
    earlier, n_earlier = loaded.get("conversation"), loaded.get("tokens")
    if not isinstance(n_earlier, int) or n_earlier < 1:
        return 0, Decision(FALLBACK, f"the source conversation records a malformed origin {loaded!r}")
    reused = min(n_earlier, n_load)
    own = header_of(check_conversation_key(earlier))
    mine = own is not None and own.get("source") == served.target
    if not mine or _common_prefix(own.get("token_ids") or [], prompt) < reused:
        where = "is gone" if own is None else "holds other tokens" if mine else "is another model's"
        return 0, Decision(FALLBACK, f"the source conversation's first {n_earlier} rows were loaded from "
                                     f"conversation {earlier}, which {where}: a translation is not translated "
                                     "again, the engine re-prefills")
    return reused, earlier


def translate_rows(served: ServedTranslator, rows: dict[str, dict[int, torch.Tensor]], model: torch.nn.Module,
                   layout: CacheLayout, positions: torch.Tensor,
                   token_ids: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Translate saved source rows into the target's engine keys and values.

    Args:
        rows: {"keys": {source layer: [n, d_src]}, "values": {...}} at post_norm (`ConversationStore.load`).
        model, layout: the target's skeleton (`model_skeleton`).
        positions: [n] target positions of the rows.
        token_ids: [n] the rows' token ids, read by a translator that appends token identity
            (`attach_prompt_token_identity`).
    Returns:
        (keys, values): per target layer [n, n_kv_heads * head_dim] fp32; keys after the target's k-norm (from
        a pre_norm translator) and RoPE at `positions`, as the engine stores them.
    """
    from translators.points import keys_to_point

    with torch.no_grad():
        out = served.translator.translate_objects(rows, token_ids)
        keys = [keys_to_point(model, layout, layer, k, start=served.translator.point, end="post_rope",
                              positions=positions) for layer, k in enumerate(out["keys"])]
    return keys, out["values"]


def own_rows(rows: dict[str, dict[int, torch.Tensor]], model: torch.nn.Module, layout: CacheLayout,
             positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This model's own saved rows, back into the engine's keys and values (no translation).

    Args:
        rows: {"keys": {layer: [n, width]}, "values": {...}} for every layer, keys at post_norm as saved.
        positions: [n] the positions they were saved from (the same in the new prompt).
    Returns:
        (keys, values): per layer [n, width] fp32; keys re-rotated at `positions`.
    """
    from translators.points import keys_to_point

    with torch.no_grad():
        keys = [keys_to_point(model, layout, layer, rows["keys"][layer].float(), start=SAVED_POINT, end="post_rope",
                              positions=positions) for layer in range(layout.n_layers)]
    return keys, [rows["values"][layer] for layer in range(layout.n_layers)]


def check_served_config(extra: dict[str, Any], consumer: bool) -> dict[str, Any]:
    """Validate a connector's `kv_connector_extra_config`, reporting every problem at once.

    Keys: store (directory shared by the engines, required), model_signature (the served model's
    `infra.zoo.model_signature`, required), translator ("identity" or an artifact path; consumers only),
    max_prefix_tokens (optional cap on the served envelope).

    Raises:
        ConfigError: missing or malformed settings, all named.
    """
    problems = []
    if not isinstance(extra.get("store"), str) or not extra.get("store"):
        problems.append("store: the directory where producers save conversations (shared with consumers)")
    if not isinstance(extra.get("model_signature"), dict):
        problems.append("model_signature: the served model's signature (infra.zoo.model_signature), a dict")
    if consumer and not isinstance(extra.get("translator"), str):
        problems.append("translator: 'identity' or a translator artifact directory")
    unknown = sorted(set(extra) - {"store", "model_signature", "translator", "max_prefix_tokens"})
    if unknown:
        problems.append(f"unknown settings {unknown}")
    if problems:
        raise ConfigError("kvlingo connector settings (kv_connector_extra_config): " + "; ".join(problems))
    return extra
