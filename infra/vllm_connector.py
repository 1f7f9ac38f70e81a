"""A vLLM KV connector (vLLM 0.32, `KVConnectorBase_V1`) that serves kvlingo translators.

Producer role (`kv_role="kv_producer"`, or `kv_both`): after the step that completes a request's prompt, the
connector reads the prompt's K/V from vLLM's paged cache, rotates the keys back to post_norm at their known
positions (`translators.points.apply_rope(inverse=True)`, exact) and saves them under a fresh conversation key
(`infra.serving.ConversationStore`). The key comes back to the client in the request's `kv_transfer_params`
(`{"conversation": key}`).

Consumer role (`kv_consumer`, or `kv_both`): a request whose `kv_transfer_params` hold
`{"source_conversation": key}` is gated before anything loads (`infra.serving.gate`). If served, the
connector translates the common prefix of the saved tokens and the prompt (all but the prompt's last token)
with the served translator (`translators.Translator`: identity or an artifact), applies the target's own
k-norm/RoPE at the target positions, writes the result into vLLM's paged cache and tells vLLM those tokens
are computed; vLLM computes the rest. When the conversation returns to a model (both engines `kv_both`), the
rows it held before come back from its own saved conversation untranslated and only the other model's new span
is translated (segment-wise hand-off). Every such request returns `{"status": "applied" | "fallback_reprefill"
| "unsupported", "reason": ..., "loaded_tokens": n, "reused_tokens": r, "translated_tokens": n - r}` in its
`kv_transfer_params`, and the connector logs each status with running totals. A translated request gets its own `cache_salt`, so its blocks never serve an
ordinary request from vLLM's prefix cache (and vice versa).

Configure it with `vllm.config.KVTransferConfig(kv_connector="KvlingoConnector",
kv_connector_module_path="infra.vllm_connector", kv_role=..., kv_connector_extra_config={...})`; the extra
config is checked by `infra.serving.check_served_config`. It runs in the serving venv (`bash
infra/bootstrap.sh --serve`). The paged layout is not hard-coded: `_SlotLayout` asks vLLM's own cache-writing
kernel where each (token, head, feature) of a block lands, so reads and writes follow the kernel's layout for
its instruction set (fp32: [num_blocks, kv_heads, block_size, 2·head_dim], keys transposed per block/head).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from infra.serving import (
    APPLIED,
    STATUSES,
    UNSUPPORTED,
    ConversationStore,
    Decision,
    ServingError,
    attach_prompt_token_identity,
    check_conversation_key,
    check_served_config,
    gate,
    model_skeleton,
    new_conversation_key,
    own_rows,
    serve_translator,
    translate_rows,
)
from translators.errors import KvlingoError
from translators.points import apply_rope

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvlingo")  # under vLLM's logger, so its handler prints these lines
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    req_id: str
    conversation: str
    start: int  # first prompt position to write
    end: int  # one past the last
    block_ids: list[int]
    translate: bool  # False: this model's own saved rows, reused as they are
    token_ids: list[int]  # the prompt's ids at [start, end) (token identity reads them)


@dataclass
class _Save:
    conversation: str
    token_ids: list[int]
    block_ids: list[int]
    loaded: dict[str, Any] | None  # where its first rows came from (`ConversationStore.save`)


@dataclass
class KvlingoConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class _RequestState:
    decision: Decision | None = None  # set when the request names a source conversation
    source: str | None = None
    conversation: str | None = None  # the key its own K/V are saved under (producers)
    save_pending: bool = False
    load: tuple[int, int] | None = None  # [start, end) to load at the next step
    loaded_tokens: int = 0


class KvlingoConnector(KVConnectorBase_V1):
    """See the module docstring. Raises ConfigError at engine start for bad `kv_connector_extra_config`,
    ServingError for a translator that cannot be resolved, PairMismatchError for one fitted for another
    target model."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._producer = transfer.is_kv_producer
        self._consumer = transfer.is_kv_consumer
        self._extra = check_served_config(dict(transfer.kv_connector_extra_config or {}), self._consumer)
        self._store = ConversationStore(self._extra["store"])
        self._signature: dict[str, Any] = self._extra["model_signature"]
        self._block_size = vllm_config.cache_config.block_size
        self._model_dir = vllm_config.model_config.model
        self._model, self._layout = model_skeleton(self._model_dir)
        self._served = None
        if self._consumer:
            self._served = serve_translator(self._extra["translator"], self._layout, self._signature,
                                            self._extra.get("max_prefix_tokens"))
            attach_prompt_token_identity(self._served, self._model, self._model_dir)
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        self._request_objects: dict[str, Request] = {}
        self._counts: Counter[str] = Counter({status: 0 for status in STATUSES})
        # Worker side.
        self._caches: dict[int, torch.Tensor] = {}  # layer index → [num_blocks, kv_heads, block_size, 2·head_dim]
        self._layer_names: dict[int, str] = {}
        self._slot_layout: _SlotLayout | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            logger.info("kvlingo connector: %s%s, store %s%s", "producer" if self._producer else "",
                        " consumer" if self._consumer else "", self._store.directory,
                        f", translator {self._served.ref} (envelope {self._served.envelope})" if self._served else "")

    # ---- scheduler side ------------------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        state = _RequestState()
        params = request.kv_transfer_params or {}
        source = params.get("source_conversation")
        if source is not None:
            state.source = str(source)
            state.decision = self._decide(request, source)
            if state.decision.status == APPLIED:
                # Isolate translated blocks in the prefix cache: hash them under a salt of their own (the hashes
                # were computed when the request was made, so they are recomputed here, before any lookup).
                salt = f"kvlingo:{self._served.identity}:{source}"
                request.cache_salt = f"{salt}:{request.cache_salt}" if request.cache_salt else salt
                request.block_hashes = []
                request.update_block_hashes()
        if self._producer:
            # Saved with its origin: the gate never translates its loaded rows again (they are reused by the
            # model they came from, or re-prefilled).
            state.conversation = new_conversation_key()
            state.save_pending = True
        self._requests[request.request_id] = state
        self._request_objects[request.request_id] = request

    def _decide(self, request: "Request", source: Any) -> Decision:
        if not self._consumer:
            return Decision(UNSUPPORTED, "this engine's kvlingo connector is not a consumer (kv_role kv_producer)")
        try:
            key = check_conversation_key(source)
            return gate(self._served, self._store.header, list(request.prompt_token_ids or []), key)
        except ServingError as err:
            return Decision(UNSUPPORTED, str(err))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None or state.decision is None or state.decision.status != APPLIED:
            return 0, False
        return max(0, state.decision.n_load - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        end = state.decision.n_load
        state.load = (end - num_external_tokens, end)
        state.loaded_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KvlingoConnectorMetadata()
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            state, request = self._requests.get(req_id), self._request_objects.get(req_id)
            if state is None or request is None:
                continue
            if state.load is not None:
                meta.loads.extend(self._loads(req_id, state))
                state.load = None
            # num_computed_tokens is still the count before this step (vLLM updates it after building this).
            if state.save_pending and request.num_computed_tokens + n_scheduled >= request.num_prompt_tokens:
                decision = state.decision
                loaded = ({"conversation": state.source, "tokens": decision.n_load}
                          if decision is not None and decision.status == APPLIED else None)
                meta.saves.append(_Save(state.conversation, list(request.prompt_token_ids), self._block_ids(req_id),
                                        loaded))
                state.save_pending = False
        return meta

    def _loads(self, req_id: str, state: _RequestState) -> list[_Load]:
        """The rows [start, end) to write, split into this model's own reused rows and translated ones."""
        start, end = state.load
        decision, blocks = state.decision, self._block_ids(req_id)
        prompt = list(self._request_objects[req_id].prompt_token_ids or [])
        loads = []
        if decision.own is not None and start < decision.reused:
            stop = min(end, decision.reused)
            loads.append(_Load(req_id, decision.own, start, stop, blocks, False, prompt[start:stop]))
        if end > max(start, decision.reused):
            first = max(start, decision.reused)
            loads.append(_Load(req_id, state.source, first, end, blocks, True, prompt[first:end]))
        return loads

    def _block_ids(self, req_id: str) -> list[int]:
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        self._request_objects.pop(request.request_id, None)
        if state is None:
            return False, None
        params: dict[str, Any] = {}
        if state.conversation is not None and not state.save_pending:
            params["conversation"] = state.conversation
        if state.decision is not None:
            decision = state.decision
            self._counts[decision.status] += 1
            reused = max(0, decision.reused - (decision.n_load - state.loaded_tokens))  # prefix-cache hits first
            params |= {"status": decision.status, "reason": decision.reason, "loaded_tokens": state.loaded_tokens,
                       "reused_tokens": reused, "translated_tokens": state.loaded_tokens - reused}
            totals = " ".join(f"{status}={self._counts[status]}" for status in STATUSES)
            logger.info("kvlingo request %s: %s (%s), loaded %d tokens [totals %s]", request.request_id,
                        decision.status, decision.reason, state.loaded_tokens, totals)
        return False, params or None

    # ---- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        for name, cache in kv_caches.items():
            match = _LAYER.search(name)
            if match is None:
                raise ServingError(f"kvlingo connector: cannot tell the layer index of KV cache {name!r}")
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                raise ServingError(f"kvlingo connector: KV cache {name!r} is not a 4-d paged tensor (CPU backend)")
            self._caches[int(match.group(1))] = cache
            self._layer_names[int(match.group(1))] = name
        if sorted(self._caches) != list(range(self._layout.n_layers)):
            raise ServingError(f"kvlingo connector: KV caches for layers {sorted(self._caches)}, the model has "
                               f"{self._layout.n_layers}")

    def _slots(self) -> "_SlotLayout":
        if self._slot_layout is None:
            layer = self._vllm_config.compilation_config.static_forward_context[self._layer_names[0]]
            cache = self._caches[0]
            self._slot_layout = _SlotLayout(cache, getattr(layer, "isa", "vec"), self._layout.layers[0].kv.head_dim)
        return self._slot_layout

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", []):
            try:
                self._load(load)
            except (KvlingoError, OSError, RuntimeError) as err:
                # vLLM recomputes the blocks reported here, so the answer stays correct.
                logger.error("kvlingo request %s: loading conversation %s failed, vLLM recomputes it: %s",
                             load.req_id, load.conversation, err)
                first, last = load.start // self._block_size, (load.end - 1) // self._block_size
                self._load_errors |= set(load.block_ids[first:last + 1])

    def _load(self, load: _Load) -> None:
        positions = torch.arange(load.start, load.end)
        if load.translate:
            rows = self._store.load(load.conversation, self._served.translator.source_layers(), load.start, load.end)
            keys, values = translate_rows(self._served, rows, self._model, self._layout, positions,
                                          torch.tensor(load.token_ids, dtype=torch.long))
        else:
            rows = self._store.load(load.conversation, list(range(self._layout.n_layers)), load.start, load.end)
            keys, values = own_rows(rows, self._model, self._layout, positions)
        slots = self._slots()
        for layer, cache in self._caches.items():
            slots.write(cache, load.block_ids, positions, keys[layer], values[layer])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen in wait_for_save, once the step has written every layer

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for save in getattr(meta, "saves", []):
            n = len(save.token_ids)
            positions = torch.arange(n)
            keys, values = [], []
            slots = self._slots()
            for layer in range(self._layout.n_layers):
                k, v = slots.read(self._caches[layer], save.block_ids, positions)
                with torch.no_grad():
                    keys.append(apply_rope(self._model, self._layout, layer, k.float(), positions, inverse=True))
                values.append(v)
            self._store.save(save.conversation, keys, values, save.token_ids, self._signature, save.loaded)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


class _SlotLayout:
    """Where vLLM's CPU cache kernel puts each (token, head, feature) of a block, learnt from the kernel itself.

    A scratch block is written through `cpu_attn_reshape_and_cache` (the op vLLM's CPU attention uses) with
    each element's index as its value, in base-64 digits so every digit is exact in any float dtype; reading
    the scratch back gives the flat offset of every key and value element within a block.

    Args:
        cache: one layer's cache, [num_blocks, kv_heads, block_size, 2·head_dim].
        isa: the attention layer's kernel flavour (`layer.isa`: vec, vec16, amx, neon...).
    """

    def __init__(self, cache: torch.Tensor, isa: str, head_dim: int):
        from vllm import _custom_ops as ops

        _, heads, block_size, width = cache.shape
        if width != 2 * head_dim:
            raise ServingError(f"paged cache rows hold {width} features, expected 2 × head_dim {head_dim}")
        self.block_size, self.heads, self.head_dim = block_size, heads, head_dim
        n = block_size * heads * head_dim
        index = torch.arange(n).view(block_size, heads, head_dim)
        digits = 1
        while 64 ** digits < n:
            digits += 1
        offsets = {}
        for part in ("key", "value"):
            found = torch.zeros(cache[0].numel(), dtype=torch.long)
            written = torch.zeros(cache[0].numel(), dtype=torch.bool)
            for d in range(digits):
                code = ((index // 64 ** d) % 64 + 1).to(cache.dtype)  # 1..64: zero means "not written"
                zero = torch.zeros_like(code)
                scratch = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype)
                view = scratch.view(1, heads, block_size * 2, head_dim)
                key_cache, value_cache = view.chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(code if part == "key" else zero, zero if part == "key" else code,
                                               key_cache, value_cache, torch.arange(block_size), isa)
                flat = scratch.reshape(-1).to(torch.float32).round().long()
                written |= flat > 0
                found += (flat - 1).clamp(min=0) * 64 ** d
            where = written.nonzero().squeeze(1)
            if where.numel() != n:
                raise ServingError(f"vLLM's cache kernel ({isa}) wrote {where.numel()} {part} elements of a block, "
                                   f"expected {n}: unsupported paged layout")
            table = torch.empty(n, dtype=torch.long)
            table[found[where]] = where
            offsets[part] = table.view(block_size, heads, head_dim)
        self.key_offsets, self.value_offsets = offsets["key"], offsets["value"]

    def _address(self, block_ids: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]  # [n]
        return blocks[:, None, None], positions % self.block_size

    def read(self, cache: torch.Tensor, block_ids: list[int], positions: torch.Tensor):
        """K and V of `positions` of a request with these blocks: two [n, kv_heads · head_dim] tensors."""
        blocks, within = self._address(block_ids, positions)
        flat = cache.view(cache.shape[0], -1)
        n = positions.numel()
        return (flat[blocks, self.key_offsets[within]].reshape(n, -1),
                flat[blocks, self.value_offsets[within]].reshape(n, -1))

    def write(self, cache: torch.Tensor, block_ids: list[int], positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store keys/values [n, kv_heads · head_dim] at `positions` of a request with these blocks."""
        blocks, within = self._address(block_ids, positions)
        flat = cache.view(cache.shape[0], -1)
        n = positions.numel()
        flat[blocks, self.key_offsets[within]] = keys.view(n, self.heads, self.head_dim).to(cache.dtype)
        flat[blocks, self.value_offsets[within]] = values.view(n, self.heads, self.head_dim).to(cache.dtype)
