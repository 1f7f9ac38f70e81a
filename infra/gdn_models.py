"""The embedded Gated DeltaNet hybrid family: ``kvlingo-tiny-s-gdn`` and ``kvlingo-tiny-l-gdn``.

Derived from the embedded GQA pair (:mod:`infra.tiny_models`) the way attention→linear-attention hybrids are
derived in practice (LoLCATs, RADLADS, HALO): replace most token mixers by linear-attention layers, align each
new mixer's output with the attention it replaces, then distil the logits. Builds are deterministic (fixed
seeds, fp32), cached under ``kvlingo_home()/models/<name>/`` beside a ``kvlingo_build.json`` whose recipe holds
the parent's recipe hash, so rebuilding a parent invalidates its hybrid.

Architecture: ``Qwen3_5ForCausalLM`` (Qwen3.5 / Qwen3-Next class, transformers' pure-torch GDN fallback on CPU).
``kvlingo-tiny-s-gdn``: layers 0-2 Gated DeltaNet, layer 3 full attention (tiny-s has 4 layers).
``kvlingo-tiny-l-gdn``: layers 0-3 Gated DeltaNet, layers 4 and 5 full attention (tiny-l has 6 layers); the last
layer stays attention in both, since it holds the copy heads the tiny models were trained with. Both have the
same state geometry, the paper's Pair B setting (same-geometry generations): per linear layer a recurrent state
[B, Hv=4, dk=32, dv=32] and a conv window [B, C=2*Hk*dk+Hv*dv=256, K=4] (Hk = 2 key heads). Like kvlingo-tiny-l,
which grew from kvlingo-tiny-s (its layers 0, 2, 3, 5 from tiny-s's 0-3), kvlingo-tiny-l-gdn's mixers in layers
0, 2, 3 start from kvlingo-tiny-s-gdn's trained mixers 0-2, grown to the wider stream (:func:`grow_mixers`); its
layer 1 (inserted by the growth) starts fresh. Without that lineage (mixers of both from independent inits) the
two hybrids' states were unrelated: copying them was no better than zero states.

Transfer (exact, checked by :func:`derive_gdn` on calibration tokens with every layer kept as attention):

* embeddings, MLPs and the (tied) LM head are copied; Qwen3.5's RMSNorms are zero-centred (gain 1 + w), so
  every norm's weight is the Qwen3 gain minus one;
* attention layers: Qwen3.5's gated attention projects [query | output gate] per head; the gate rows are zero
  (sigmoid(0) = 1/2) and ``o_proj`` is doubled, which reproduces Qwen3 attention exactly; RoPE is full
  (``partial_rotary_factor = 1``) with the parent's theta (the multimodal sections coincide for text positions);
* Gated DeltaNet mixers start from transformers' default initialisation (initialising them from the attention's
  q/k/v/o gave no gain when this recipe was measured).

Training, mixers only (everything else frozen): ``mse_steps`` steps aligning each GDN mixer's output with the
parent attention output at that layer given the parent's own layer input (all layers at once, relative MSE),
then ``kl_steps`` steps of KL(parent ‖ hybrid) on the logits, weighted like the tiny builds (assistant tokens
1, context 0.25). Every training row holds exactly one conversation, right-padded: packed rows would leak the
recurrent state from one conversation into the next (:func:`conversation_rows`).

``python -m infra.gdn_models build`` builds both (and their parents if needed) and prints recall next to each
parent's. Measured (``OMP_NUM_THREADS=1 python -m infra.gdn_models build --items 180``, one thread, 2 cores shared
with other jobs; KL per token on 24 held-out conversations, recall on 180 held-out items):

==================  ======  ====================================  ==========================
model               build   KL converted -> aligned -> distilled  recall (GQA parent)
==================  ======  ====================================  ==========================
kvlingo-tiny-s-gdn  107 s   2.232 -> 0.255 -> 0.022               0.867 (kvlingo-tiny-s 0.889)
kvlingo-tiny-l-gdn  212 s   1.355 -> 0.106 -> 0.010               0.922 (kvlingo-tiny-l 0.933)
==================  ======  ====================================  ==========================

Recipe search on kvlingo-tiny-s-gdn (recall n = 180): 600 KL steps at 1e-3 without the copy weight reached KL
0.016 but recall 0.817; the copy weight 4 alone 0.833; 900 steps at 2e-3 with copy weight 8 0.861; the chosen
900 steps at 3e-3 with copy weight 4 0.867. The build is deterministic (the same recall twice).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from infra import tiny_models
from infra.mla_models import token_kl
from infra.settings import kvlingo_home
from translators.errors import ConfigError

GDN_RECIPE_VERSION = 1
VALIDATION_SEED = 1  # training-stream seed of the validation conversations (disjoint from CORPUS_SEED's)
VALIDATION_CONVERSATIONS = 24
LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class GDNSpec:
    """How one GDN hybrid derives from its GQA parent (a tiny model).

    ``layer_types``: one of LINEAR / FULL per parent layer. The state geometry fields are the same for the
    whole family so that states can be copied between its members.
    """

    parent: str
    layer_types: tuple[str, ...]
    mixers_from: str | None = None  # a narrower, shallower member whose trained mixers start this one's (grown)
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    mse_steps: int = 300
    kl_steps: int = 900
    batch_size: int = 2  # conversations per step
    max_tokens: int = 512  # a conversation longer than this is cut
    mse_lr: float = 3e-3
    kl_lr: float = 3e-3
    copy_weight: float = 4.0  # extra KL weight where the next token is copied from earlier in the conversation
    warmup_frac: float = 0.05
    # Chunk length of the pure-torch chunked delta rule while training (the models then run with transformers'
    # 64). The chunked form is exact for any chunk length (outputs agree to fp32 rounding). Gated DeltaNet's decay
    # is one scalar per head, and 16 trained no faster here (56 vs 63 ms per MSE step, 84 vs 79 per KL step);
    # KDA's per-channel decay makes its intra-chunk work [C, C, d], where 16 pays (`infra.kda_models`).
    train_chunk_size: int = 64
    seed: int = 21
    # Declared context. The parents declare 2048 but train on conversations of at most 512 tokens, so neither bound
    # is a trained one; the GDN layers have no positions and the attention layers' default RoPE has no
    # length-dependent scaling, so the weights and the computation do not depend on it. 8192 lets `bench speed` time
    # the 4096-token prompts (plus decoded tokens) between the hybrids; answers that far out are not
    # measured for quality.
    max_position_embeddings: int = 8192


GDN_MODELS: dict[str, GDNSpec] = {
    "kvlingo-tiny-s-gdn": GDNSpec(parent="kvlingo-tiny-s", layer_types=(LINEAR, LINEAR, LINEAR, FULL)),
    # Layers 0, 2, 3 of kvlingo-tiny-l grew from kvlingo-tiny-s's 0-2 (the linear layers of kvlingo-tiny-s-gdn),
    # whose trained mixers start theirs; layer 1 (inserted by the growth) gets a fresh mixer.
    "kvlingo-tiny-l-gdn": GDNSpec(parent="kvlingo-tiny-l", layer_types=(LINEAR, LINEAR, LINEAR, LINEAR, FULL, FULL),
                                  mixers_from="kvlingo-tiny-s-gdn", seed=22),
}


# --- Names, recipes, cache ----------------------------------------------------------------------


def spec_for(name: str) -> GDNSpec:
    """The spec of ``name``.

    Raises:
        ConfigError: unknown name (with the nearest known one of this family).
    """
    if name in GDN_MODELS:
        return GDN_MODELS[name]
    close = difflib.get_close_matches(name, list(GDN_MODELS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"Unknown embedded GDN hybrid {name!r}; known: {sorted(GDN_MODELS)}.{hint}")


def _recipe(name: str) -> dict:
    """Everything that determines the build of ``name``; the parent enters by its recipe hash."""
    spec = spec_for(name)
    recipe = {"gdn_recipe_version": GDN_RECIPE_VERSION, "name": name, "spec": asdict(spec),
              "parent_recipe_hash": tiny_models.recipe_hash(spec.parent), "validation_seed": VALIDATION_SEED}
    if spec.mixers_from is not None:
        recipe["mixers_recipe_hash"] = recipe_hash(spec.mixers_from)
    return recipe


def recipe_hash(name: str) -> str:
    """The build-recipe hash of ``name`` (changes whenever its parent's recipe hash changes).

    Raises:
        ConfigError: unknown name.
    """
    return tiny_models._hash(_recipe(name))


def ensure_gdn_model(name: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Directory of the built hybrid ``name``, deriving it (and its parent) first if no matching cache exists.

    Loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        ConfigError: unknown name.
    """
    spec = spec_for(name)
    models_dir = Path(home if home is not None else kvlingo_home()) / "models"
    final = models_dir / name
    recipe = _recipe(name)
    if tiny_models.is_built(final, recipe):
        return final
    # Before taking this model's build lock: a process holds one build lock at a time.
    parent_dir = tiny_models.ensure_tiny_model(spec.parent, home=home, progress=progress)
    mixers_dir = ensure_gdn_model(spec.mixers_from, home=home, progress=progress) if spec.mixers_from else None
    return tiny_models.build_under_lock(final, recipe,
                                        lambda tmp: _write_model(name, parent_dir, tmp, progress, mixers_dir),
                                        threads=tiny_models.DERIVED_BUILD_THREADS)


def load_gdn_model(name: str, *, home: Path | None = None, progress: bool = True):
    """(model, tokenizer) of ``name``, built on first use; the model is in eval mode, fp32.

    Raises:
        ConfigError: unknown name.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_gdn_model(name, home=home, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="float32")
    model.eval()
    return model, AutoTokenizer.from_pretrained(directory)


def _write_model(name: str, parent_dir: Path, out: Path, progress: bool, mixers_dir: Path | None) -> dict:
    """Derive ``name`` from the model in ``parent_dir`` (mixers grown from the hybrid in ``mixers_dir`` if given)
    and save it (with the tokenizer) into ``out``.

    Returns extra build-json fields (timings and KL measurements).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    spec = spec_for(name)
    tokenizer = AutoTokenizer.from_pretrained(parent_dir)
    parent = AutoModelForCausalLM.from_pretrained(parent_dir, dtype="float32").eval()
    mixers = AutoModelForCausalLM.from_pretrained(mixers_dir, dtype="float32").eval() if mixers_dir else None
    model, info = derive_gdn(parent, tokenizer, spec, progress=progress, description=name, mixers=mixers)
    tiny_models._set_generation_config(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"train_seconds": round(time.perf_counter() - started, 1), **info,
            "torch": torch.__version__, "transformers": transformers.__version__}


# --- Data: one conversation per row -------------------------------------------------------------


def conversation_rows(tokenizer, count: int, seed: int, max_tokens: int) -> dict:
    """``count`` rows, each exactly one rendered conversation of the synthetic chat stream ``seed``.

    Returns (count, T) tensors, T the longest conversation (at most ``max_tokens``), right-padded with the
    end-of-text id: ``input_ids``, ``weights`` (loss weight of each token as a prediction target, 0 on padding;
    assistant tokens 1, context 0.25 as in the tiny builds), ``copies`` (1 where the next token is an assistant
    token copied from earlier in the conversation: the recall positions) and ``lengths`` (count,). Right padding never
    reaches a real token (causal mixers), and no row holds two conversations, so no recurrent state crosses a
    conversation boundary.
    """
    import torch

    from infra.synthetic_chat import generate_conversations

    chats = generate_conversations(count, seed)
    texts = [tiny_models.render_chat(c) + tiny_models.ENDOFTEXT for c in chats]
    encoded = [e.ids[:max_tokens] for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    ids_of = {t: tokenizer.convert_tokens_to_ids(t) for t in (*tiny_models.SPECIAL_TOKENS, "assistant")}
    annotate_spec = tiny_models.TINY_MODELS["kvlingo-tiny-s"]  # answer/context weights of the tiny builds
    width = max(len(ids) for ids in encoded)
    out = {"input_ids": torch.full((count, width), ids_of[tiny_models.ENDOFTEXT], dtype=torch.long),
           "weights": torch.zeros((count, width), dtype=torch.float32),
           "copies": torch.zeros((count, width), dtype=torch.float32),
           "lengths": torch.tensor([len(ids) for ids in encoded])}
    for r, ids in enumerate(encoded):
        weights, _, copy_limit = tiny_models._annotate(ids, ids_of, annotate_spec)
        out["input_ids"][r, :len(ids)] = torch.tensor(ids)
        out["weights"][r, :len(ids)] = torch.tensor(weights)
        out["copies"][r, :len(ids)] = (torch.tensor(copy_limit) >= 0).float()
    return out


def _batch(rows: dict, start: int, size: int) -> dict:
    """Rows ``start:start+size``, cut to their longest conversation (less padding to compute).

    Raises:
        ConfigError: the rows are packed (position ids restarting mid-row, as in the tiny builds' rows): a
            hybrid's recurrent state would leak between conversations (:func:`translators.capture.check_unpacked`).
    """
    from translators.capture import check_unpacked

    picked = {key: value[start:start + size] for key, value in rows.items()}
    check_unpacked(picked.get("position_ids"))
    width = int(picked["lengths"].max())
    return {"input_ids": picked["input_ids"][:, :width], "weights": picked["weights"][:, :width],
            "copies": picked["copies"][:, :width], "lengths": picked["lengths"]}


def mean_kl(teacher, student, rows: dict, batch_size: int = 8) -> float:
    """Mean per-token KL(teacher || student) over the real (non-padding) tokens of ``rows``."""
    import torch

    total, count = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(rows["input_ids"]), batch_size):
            batch = _batch(rows, start, batch_size)
            ids = batch["input_ids"]
            kl = token_kl(teacher(input_ids=ids, use_cache=False).logits,
                          student(input_ids=ids, use_cache=False).logits)
            real = (torch.arange(ids.shape[1]).view(1, -1) < batch["lengths"].view(-1, 1)).float()
            total += (kl * real).sum().item()
            count += real.sum().item()
    return total / max(count, 1.0)


# --- Qwen3 (GQA) -> Qwen3.5 (GDN hybrid) --------------------------------------------------------


def gdn_config(source_config, spec: GDNSpec):
    """The Qwen3_5TextConfig of the hybrid conversion of a Qwen3 config.

    Raises:
        ConfigError: ``layer_types`` does not name one LINEAR/FULL type per source layer, or the source RoPE is
            not the full default one.
    """
    from transformers import Qwen3_5TextConfig

    layers = source_config.num_hidden_layers
    if len(spec.layer_types) != layers or set(spec.layer_types) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of the {layers} source layers, "
                          f"got {list(spec.layer_types)}")
    rope = dict(source_config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"GDN conversion needs full default RoPE, got {rope}")
    return Qwen3_5TextConfig(
        vocab_size=source_config.vocab_size, hidden_size=source_config.hidden_size,
        intermediate_size=source_config.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=source_config.num_attention_heads, num_key_value_heads=source_config.num_key_value_heads,
        head_dim=source_config.head_dim, hidden_act=source_config.hidden_act, rms_norm_eps=source_config.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"], "partial_rotary_factor": 1.0},
        tie_word_embeddings=source_config.tie_word_embeddings, attention_bias=False,
        layer_types=list(spec.layer_types), linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim, linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads, linear_num_value_heads=spec.linear_num_value_heads,
        pad_token_id=source_config.pad_token_id, bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id)


def convert_qwen3_to_gdn(parent, spec: GDNSpec):
    """A Qwen3_5ForCausalLM holding every parent weight but the mixers of the LINEAR layers (fresh GDN).

    Attention layers reproduce the parent's exactly (see the module docstring); the GDN mixers keep
    transformers' initialisation (seeded by the caller).

    Raises:
        ConfigError: see :func:`gdn_config`. RuntimeError: a weight did not transfer.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    config = gdn_config(parent.config, spec)
    target = Qwen3_5ForCausalLM(config).float()
    source = parent.state_dict()
    state = {}
    heads, head_dim = config.num_attention_heads, config.head_dim
    for key, value in source.items():
        if key.endswith("norm.weight"):  # input/post-attention/final/q/k norms: Qwen3.5 stores gain - 1
            value = value - 1.0
        parts = key.split(".")
        if parts[:2] == ["model", "layers"] and spec.layer_types[int(parts[2])] == LINEAR and parts[3] == "self_attn":
            continue  # this layer's mixer is a fresh Gated DeltaNet
        if key.endswith("self_attn.q_proj.weight"):
            q = value.view(heads, head_dim, -1)
            value = torch.cat([q, torch.zeros_like(q)], dim=1).reshape(heads * 2 * head_dim, -1)
        elif key.endswith("self_attn.o_proj.weight"):
            value = value * 2.0  # the zero gate multiplies the attention output by sigmoid(0) = 1/2
        state[key] = value
    missing, unexpected = target.load_state_dict(state, strict=False)
    if unexpected or any(".linear_attn." not in key and key != "lm_head.weight" for key in missing):
        raise RuntimeError(f"GDN weight transfer: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        target.tie_weights()
    elif "lm_head.weight" in source:
        target.lm_head.weight.data.copy_(source["lm_head.weight"])
    target.eval()
    return target


def grow_mixers(child, parent) -> dict[int, int]:
    """Start ``child``'s GDN mixers from ``parent``'s (a narrower, shallower hybrid of the same state geometry).

    Child layer c takes parent layer p's mixer where the tiny models' growth placed p at c
    (:func:`infra.tiny_models._layer_placement`) and both are linear; other child mixers keep their init.
    Projections reading the hidden state keep the parent's columns on the leading (grown-from) dims and read
    nothing from the new ones; ``out_proj`` writes the parent's rows on the leading dims and zero on the new
    ones; the conv, gates and norm are copied. Returns {child layer: parent layer} of the grown mixers.

    Raises:
        ConfigError: the state geometry differs or the child is narrower.
    """
    import torch

    geometry = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
    differ = [key for key in geometry if getattr(child.config, key) != getattr(parent.config, key)]
    d = parent.config.hidden_size
    if differ or child.config.hidden_size < d:
        raise ConfigError(f"cannot grow GDN mixers: geometry differs in {differ}, hidden {d} -> "
                          f"{child.config.hidden_size}")
    placement = tiny_models._layer_placement(parent.config.num_hidden_layers, child.config.num_hidden_layers)
    grown = {}
    with torch.no_grad():
        for c, p in enumerate(placement):
            if p is None or child.config.layer_types[c] != LINEAR or parent.config.layer_types[p] != LINEAR:
                continue
            new, old = child.model.layers[c].linear_attn, parent.model.layers[p].linear_attn
            for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                getattr(new, part).weight.zero_()[:, :d] = getattr(old, part).weight
            new.out_proj.weight.zero_()[:d] = old.out_proj.weight
            new.conv1d.weight.copy_(old.conv1d.weight)
            new.dt_bias.copy_(old.dt_bias)
            new.A_log.copy_(old.A_log)
            new.norm.weight.copy_(old.norm.weight)
            grown[c] = p
    return grown


def mixer_parameters(model) -> list:
    """The parameters of every linear-attention mixer (GDN or KDA: all a GDN hybrid's training touches)."""
    from translators.layout import linear_mixer

    return [p for layer in model.model.layers if linear_mixer(layer) is not None for p in linear_mixer(layer).parameters()]


class _AttentionIO:
    """Per layer, the input (normalised hidden state) and output of a Qwen3 parent's attention (hooks)."""

    def __init__(self, model, layers: Sequence[int]):
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.handles = []
        for i in layers:
            attn = model.model.layers[i].self_attn
            self.handles.append(attn.register_forward_pre_hook(self._input_hook(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._output_hook(i)))

    def _input_hook(self, i: int):
        def hook(module, args, kwargs):
            self.inputs[i] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
        return hook

    def _output_hook(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = output[0].detach()
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _train(params: list, loss_of, rows: dict, steps: int, spec, lr: float, *, progress: bool,
           description: str) -> list[float]:
    """AdamW (no weight decay) over ``steps`` batches of ``spec.batch_size`` conversations from ``rows``, cycling.

    Raises:
        RuntimeError: a non-finite loss.
    """
    import torch

    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    n_rows = len(rows["input_ids"])
    batches = (_batch(rows, (step * spec.batch_size) % n_rows, spec.batch_size) for step in range(steps))
    # One thread: a step is thousands of tiny kernels (the chunked delta rule's Python loops), and under the
    # platform's OMP_WAIT_POLICY=PASSIVE (infra.settings) a second thread mostly waits to be woken. Measured on
    # kvlingo-tiny-l-gdn (2 cores, session 16): 174 ms per KL step on one thread against 271 on two (113 vs 206 ms
    # per MSE step); with libgomp's default active waiting two threads took 112 ms.
    return tiny_models.optimise(optimizer, params, loss_of, batches,
                                lambda step: tiny_models.lr_at(step, steps, lr, spec.warmup_frac), steps=steps,
                                threads=tiny_models.DERIVED_BUILD_THREADS, progress=progress, description=description)


def align_mixers(hybrid, parent, rows: dict, spec, *, progress: bool = True,
                 description: str = "align") -> list[float]:
    """Train each linear-attention mixer to reproduce the parent attention's output from the parent's own layer
    input (``spec``: a GDNSpec or `infra.kda_models.KDASpec`).

    Loss: mean over LINEAR layers of ||mixer(x) - attn(x)||² / ||attn(x)||² on real tokens.
    """
    import torch

    from translators.layout import linear_mixer

    linear = [i for i, kind in enumerate(spec.layer_types) if kind == LINEAR]
    io = _AttentionIO(parent, linear)
    params = mixer_parameters(hybrid)
    hybrid.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    hybrid.train()

    def loss_of(batch):
        with torch.no_grad():
            parent(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=1)
        real = (torch.arange(batch["input_ids"].shape[1]).view(1, -1) < batch["lengths"].view(-1, 1)).unsqueeze(-1)
        losses = []
        for i in linear:
            target = io.outputs[i]
            predicted = linear_mixer(hybrid.model.layers[i])(hidden_states=io.inputs[i],
                                                             chunk_size=spec.train_chunk_size)
            err = ((predicted - target) * real).pow(2).sum()
            losses.append(err / (target * real).pow(2).sum().clamp_min(1e-12))
        return sum(losses) / len(losses)

    try:
        return _train(params, loss_of, rows, spec.mse_steps, spec, spec.mse_lr, progress=progress,
                      description=f"{description} mse")
    finally:
        io.close()
        hybrid.eval()
        hybrid.requires_grad_(False)


def distill_mixers(hybrid, parent, rows: dict, spec, *, progress: bool = True, description: str = "distill",
                   params: list | None = None) -> list[float]:
    """KL-distil the hybrid's linear-attention mixers (or ``params``) to the parent on one-conversation rows.

    Weighted like the tiny builds (the weight of each position's next token), plus ``spec.copy_weight`` where
    the next token is copied from earlier in the conversation: recall hinges on those few positions, and the
    mixers, which replace attention, are what must carry the copied values forward.
    """
    import torch

    params = mixer_parameters(hybrid) if params is None else params
    hybrid.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    hybrid.train()

    def loss_of(batch):
        ids = batch["input_ids"]
        with torch.no_grad():
            teacher = parent(input_ids=ids, use_cache=False).logits
        student = hybrid(input_ids=ids, use_cache=False, chunk_size=spec.train_chunk_size).logits
        kl = token_kl(teacher, student)[:, :-1]
        weights = batch["weights"][:, 1:] + spec.copy_weight * batch["copies"][:, :-1]
        return (kl * weights).sum() / weights.sum().clamp_min(1e-6)

    try:
        return _train(params, loss_of, rows, spec.kl_steps, spec, spec.kl_lr, progress=progress,
                      description=f"{description} kl")
    finally:
        hybrid.eval()
        hybrid.requires_grad_(False)


def derive_gdn(parent, tokenizer, spec: GDNSpec, *, progress: bool = True, description: str = "gdn", mixers=None):
    """Convert a Qwen3 parent to a GDN hybrid and train its mixers; returns (model, build-json fields).

    ``mixers``: a narrower, shallower hybrid of this family (``spec.mixers_from``) whose mixers start this one's
    (:func:`grow_mixers`), so the two have related states like consecutive generations of one model.

    Raises:
        RuntimeError: the attention transfer is not exact (every layer kept as attention must reproduce the
            parent's logits within 1e-4) or training diverged.
    """
    import torch

    needed = max(spec.mse_steps, spec.kl_steps) * spec.batch_size
    rows = conversation_rows(tokenizer, needed, tiny_models.CORPUS_SEED, spec.max_tokens)
    validation = conversation_rows(tokenizer, VALIDATION_CONVERSATIONS, VALIDATION_SEED, spec.max_tokens)
    # The transfer is exact: with every layer kept as attention, the converted model is the parent.
    all_attention = GDNSpec(**{**asdict(spec), "layer_types": (FULL,) * len(spec.layer_types)})
    check = convert_qwen3_to_gdn(parent, all_attention)
    with torch.no_grad():
        ids = _batch(validation, 0, 2)["input_ids"]
        transfer_error = (check(input_ids=ids, use_cache=False).logits
                          - parent(input_ids=ids, use_cache=False).logits).abs().max().item()
    if transfer_error > 1e-4:
        raise RuntimeError(f"GDN conversion: attention transfer differs from the parent by {transfer_error:.2e}")
    torch.manual_seed(spec.seed)
    hybrid = convert_qwen3_to_gdn(parent, spec)
    grown = grow_mixers(hybrid, mixers) if mixers is not None else {}
    kl_converted = mean_kl(parent, hybrid, validation)
    started = time.perf_counter()
    mse = align_mixers(hybrid, parent, rows, spec, progress=progress, description=description)
    mse_seconds = time.perf_counter() - started
    kl_aligned = mean_kl(parent, hybrid, validation)
    started = time.perf_counter()
    kl = distill_mixers(hybrid, parent, rows, spec, progress=progress, description=description)
    kl_seconds = time.perf_counter() - started
    kl_distilled = mean_kl(parent, hybrid, validation)
    return hybrid, {
        "mixers_grown_from": {str(k): v for k, v in grown.items()},
        "transfer_max_abs_logit_diff": transfer_error, "kl_converted": round(kl_converted, 4),
        "kl_aligned": round(kl_aligned, 4), "kl_distilled": round(kl_distilled, 4),
        "mse_final": round(sum(mse[-10:]) / len(mse[-10:]), 4), "kl_final": round(sum(kl[-10:]) / len(kl[-10:]), 4),
        "mse_seconds": round(mse_seconds, 1), "kl_seconds": round(kl_seconds, 1)}


# --- CLI ----------------------------------------------------------------------------------------


def _cli_build(args: argparse.Namespace) -> int:
    """Build the family (and parents if needed); print build time and recall next to each parent's."""
    import json

    from infra.synthetic_chat import recall_items

    home = Path(args.home) if args.home else None
    items = recall_items(args.items, tiny_models.HELDOUT_SEED)
    total = time.perf_counter()
    for name in args.names or list(GDN_MODELS):
        parent = spec_for(name).parent
        model, tokenizer = tiny_models.load_tiny_model(parent, home=home, progress=not args.quiet)
        parent_score = tiny_models.evaluate_recall(model, tokenizer, items)["overall"]
        started = time.perf_counter()
        directory = ensure_gdn_model(name, home=home, progress=not args.quiet)
        built = time.perf_counter() - started
        build = json.loads((directory / tiny_models.BUILD_FILE).read_text())
        model, tokenizer = load_gdn_model(name, home=home)
        score = tiny_models.evaluate_recall(model, tokenizer, items)["overall"]
        extras = "  ".join(f"{key}={build[key]}" for key in
                           ("train_seconds", "kl_converted", "kl_aligned", "kl_distilled") if key in build)
        print(f"{name}: ensure {built:.1f}s  recall={score:.3f} vs {parent} {parent_score:.3f} "
              f"(delta {score - parent_score:+.3f}, n={len(items)})  {extras}  [{directory}]")
    print(f"total wall time (build + eval): {time.perf_counter() - total:.1f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m infra.gdn_models build [NAME ...]``."""
    parser = tiny_models.build_arguments("infra.gdn_models", __doc__,
                                         "build (or reuse) the embedded GDN hybrids and report recall", items=60,
                                         names=True)
    return _cli_build(parser.parse_args(argv))

if __name__ == "__main__":
    from infra.settings import apply_offline_defaults

    apply_offline_defaults()
    sys.exit(main())
