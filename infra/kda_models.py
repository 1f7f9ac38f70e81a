"""The embedded Kimi-Linear hybrid ``kvlingo-tiny-kda``: Kimi Delta Attention layers and a NoPE MLA layer.

The paper's Pair A target (hybrid paper §7): a Kimi-Linear-class model (``KimiLinearForCausalLM``, transformers'
pure-torch KDA fallback on CPU) derived from ``kvlingo-tiny-s-mla`` (:mod:`infra.mla_models`) the way
:mod:`infra.gdn_models` derives its hybrids: layers 0-2 become Kimi Delta Attention, layer 3 keeps its MLA,
which Kimi-Linear runs without positions (NoPE: its shared key ``k_pe`` and the queries' rotary part are not
rotated, so position reaches attention only through the KDA layers' convs and recurrences). Build is
deterministic (fixed seeds, fp32), cached under ``kvlingo_home()/models/kvlingo-tiny-kda/`` beside a
``kvlingo_build.json`` whose recipe holds the parent's recipe hash.

Geometry per KDA layer: H = 4 heads of d = 32 (dk = dv = d), a recurrent state [B, 4, 32, 32] (fp32 in the
engine) and one conv window over [q | k | v], [B, C = 3 H d = 384, K = 4]. The MLA layer caches the
kv_a_layernorm-normed latent [B, 1, T, 64] and the un-rotated shared key [B, 1, T, 32].

Transfer (exact, checked by the state-dict load): embeddings, dense MLPs, RMSNorms (both families use plain
gain RMSNorms) and layer 3's MLA projections are copied; Kimi-Linear does not tie its LM head, so the parent's
tied embedding is copied into it. The KDA mixers start from transformers' initialisation.

Training (everything else frozen): ``mse_steps`` steps aligning each KDA mixer's output with the parent's MLA
output at that layer given the parent's own layer input (:func:`infra.gdn_models.align_mixers`), then
``kl_steps`` steps of KL(parent ‖ hybrid) on the logits (:func:`infra.gdn_models.distill_mixers`, with the
copy weight) over the KDA mixers and layer 3's attention, which must learn to attend without RoPE. One
conversation per row (recurrent states would leak across packed conversations). Training runs transformers'
pure-torch chunked KDA with chunks of 16 tokens instead of its default 64 (``train_chunk_size``; the chunked
form is exact for any chunk length, outputs agree to fp32 rounding): per-channel decay makes the intra-chunk work
[C, C, d] per chunk, and a training step took 108 ms instead of 354 (MSE) and 116 instead of 290 (KL) here.

``python -m infra.kda_models build`` builds it (and its parents if needed) and prints recall next to the
parent's and the GQA original's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from infra import gdn_models, mla_models, tiny_models
from infra.gdn_models import FULL, LINEAR
from infra.settings import kvlingo_home
from translators.errors import ConfigError

KDA_RECIPE_VERSION = 1
NAME = "kvlingo-tiny-kda"


@dataclass(frozen=True)
class KDASpec:
    """How the KDA hybrid derives from its MLA parent (training fields as in `infra.gdn_models.GDNSpec`)."""

    parent: str = "kvlingo-tiny-s-mla"
    layer_types: tuple[str, ...] = (LINEAR, LINEAR, LINEAR, FULL)
    linear_num_heads: int = 4
    linear_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    mse_steps: int = 300
    # 1200, not 600 (session 19, `python -m infra.kda_models build --items 120`): KL to the parent 0.065 → 0.057 and
    # recall 0.833 → 0.875 against kvlingo-tiny-s-mla's 0.892 (the 0.05 asked of a derived model; 600 missed it by
    # 0.008), for about 100 s more of build, which runs beside the GDN lineage (`kvlingo build`).
    kl_steps: int = 1200
    batch_size: int = 2
    max_tokens: int = 512
    mse_lr: float = 3e-3
    kl_lr: float = 3e-3
    copy_weight: float = 4.0
    warmup_frac: float = 0.05
    train_chunk_size: int = 16  # as in `infra.gdn_models.GDNSpec`
    seed: int = 23


KDA_MODELS: dict[str, KDASpec] = {NAME: KDASpec()}


def spec_for(name: str) -> KDASpec:
    """The spec of ``name``.

    Raises:
        ConfigError: unknown name.
    """
    if name not in KDA_MODELS:
        raise ConfigError(f"Unknown embedded KDA hybrid {name!r}; known: {sorted(KDA_MODELS)}")
    return KDA_MODELS[name]


def _recipe(name: str) -> dict:
    spec = spec_for(name)
    return {"kda_recipe_version": KDA_RECIPE_VERSION, "name": name, "spec": asdict(spec),
            "parent_recipe_hash": mla_models.recipe_hash(spec.parent),
            "validation_seed": gdn_models.VALIDATION_SEED}


def recipe_hash(name: str) -> str:
    """The build-recipe hash of ``name`` (changes whenever its parent's does). Raises ConfigError: unknown name."""
    return tiny_models._hash(_recipe(name))


def ensure_kda_model(name: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Directory of the built hybrid ``name``, deriving it (and its parents) first if no matching cache exists.

    Raises:
        ConfigError: unknown name.
    """
    spec = spec_for(name)
    final = Path(home if home is not None else kvlingo_home()) / "models" / name
    recipe = _recipe(name)
    if tiny_models.is_built(final, recipe):
        return final
    parent_dir = mla_models.ensure_mla_model(spec.parent, home=home, progress=progress)  # before the lock
    return tiny_models.build_under_lock(final, recipe, lambda tmp: _write_model(name, parent_dir, tmp, progress),
                                        threads=tiny_models.DERIVED_BUILD_THREADS)


def load_kda_model(name: str, *, home: Path | None = None, progress: bool = True):
    """(model, tokenizer) of ``name``, built on first use; eval mode, fp32. Raises ConfigError: unknown name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_kda_model(name, home=home, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(directory)


def _write_model(name: str, parent_dir: Path, out: Path, progress: bool) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(parent_dir)
    parent = AutoModelForCausalLM.from_pretrained(parent_dir, dtype="float32").eval()
    model, info = derive_kda(parent, tokenizer, spec_for(name), progress=progress, description=name)
    tiny_models._set_generation_config(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"train_seconds": round(time.perf_counter() - started, 1), **info,
            "torch": torch.__version__, "transformers": transformers.__version__}


def kda_config(parent_config, spec: KDASpec):
    """The KimiLinearConfig of the hybrid conversion of a DeepSeek-V3 (MLA, dense MLP) config.

    Raises:
        ConfigError: ``layer_types`` does not name LINEAR/FULL per parent layer, or the parent has a low-rank
            query or MoE layers (the embedded MLA models have neither).
    """
    from transformers import KimiLinearConfig

    layers = parent_config.num_hidden_layers
    if len(spec.layer_types) != layers or set(spec.layer_types) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of the {layers} parent layers, "
                          f"got {list(spec.layer_types)}")
    if parent_config.q_lora_rank is not None or parent_config.first_k_dense_replace < layers:
        raise ConfigError("the KDA conversion reads an MLA parent with a plain q_proj and dense MLPs in every layer")
    return KimiLinearConfig(
        vocab_size=parent_config.vocab_size, hidden_size=parent_config.hidden_size,
        intermediate_size=parent_config.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=parent_config.num_attention_heads, num_key_value_heads=parent_config.num_attention_heads,
        kv_lora_rank=parent_config.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=parent_config.qk_rope_head_dim,
        qk_nope_head_dim=parent_config.qk_nope_head_dim, v_head_dim=parent_config.v_head_dim,
        hidden_act=parent_config.hidden_act, rms_norm_eps=parent_config.rms_norm_eps,
        max_position_embeddings=parent_config.max_position_embeddings, tie_word_embeddings=False,
        layer_types=list(spec.layer_types), mlp_layer_types=["dense"] * layers,
        linear_num_heads=spec.linear_num_heads, linear_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim, pad_token_id=parent_config.pad_token_id,
        bos_token_id=parent_config.bos_token_id, eos_token_id=parent_config.eos_token_id)


def convert_mla_to_kda(parent, spec: KDASpec):
    """A KimiLinearForCausalLM holding every parent weight but the mixers of the LINEAR layers (fresh KDA).

    Raises:
        ConfigError: see :func:`kda_config`. RuntimeError: a weight did not transfer.
    """
    from transformers import KimiLinearForCausalLM

    target = KimiLinearForCausalLM(kda_config(parent.config, spec)).float()
    state = {key: value for key, value in parent.state_dict().items()
             if not (key.startswith("model.layers.") and spec.layer_types[int(key.split(".")[2])] == LINEAR
                     and ".self_attn." in key) and key != "lm_head.weight"}
    missing, unexpected = target.load_state_dict(state, strict=False)
    linear = {i for i, kind in enumerate(spec.layer_types) if kind == LINEAR}
    if unexpected or any(key != "lm_head.weight" and not (".self_attn." in key and int(key.split(".")[2]) in linear)
                         for key in missing):
        raise RuntimeError(f"KDA weight transfer: missing {missing}, unexpected {unexpected}")
    target.lm_head.weight.data.copy_(parent.get_output_embeddings().weight)  # Kimi-Linear never ties it
    return target.eval()


def trainable_parameters(model) -> list:
    """Every token mixer's parameters: the KDA mixers' and the MLA layers' (a NoPE MLA must relearn how it
    attends); embeddings, MLPs and norms stay the parent's."""
    return [p for layer in model.model.layers for p in layer.self_attn.parameters()]


def derive_kda(parent, tokenizer, spec: KDASpec, *, progress: bool = True, description: str = "kda"):
    """Convert the MLA parent to the KDA hybrid and train it; returns (model, build-json fields).

    Raises:
        RuntimeError: the weights did not transfer or training diverged.
    """
    import torch

    needed = max(spec.mse_steps, spec.kl_steps) * spec.batch_size
    rows = gdn_models.conversation_rows(tokenizer, needed, tiny_models.CORPUS_SEED, spec.max_tokens)
    validation = gdn_models.conversation_rows(tokenizer, gdn_models.VALIDATION_CONVERSATIONS,
                                              gdn_models.VALIDATION_SEED, spec.max_tokens)
    torch.manual_seed(spec.seed)
    hybrid = convert_mla_to_kda(parent, spec)
    kl_converted = gdn_models.mean_kl(parent, hybrid, validation)
    started = time.perf_counter()
    mse = gdn_models.align_mixers(hybrid, parent, rows, spec, progress=progress, description=description)
    mse_seconds = time.perf_counter() - started
    kl_aligned = gdn_models.mean_kl(parent, hybrid, validation)
    started = time.perf_counter()
    kl = gdn_models.distill_mixers(hybrid, parent, rows, spec, progress=progress, description=description,
                                   params=trainable_parameters(hybrid))
    kl_seconds = time.perf_counter() - started
    kl_distilled = gdn_models.mean_kl(parent, hybrid, validation)
    return hybrid, {
        "kl_converted": round(kl_converted, 4), "kl_aligned": round(kl_aligned, 4),
        "kl_distilled": round(kl_distilled, 4), "mse_final": round(sum(mse[-10:]) / len(mse[-10:]), 4),
        "kl_final": round(sum(kl[-10:]) / len(kl[-10:]), 4), "mse_seconds": round(mse_seconds, 1),
        "kl_seconds": round(kl_seconds, 1)}


def _cli_build(args: argparse.Namespace) -> int:
    """Build (or reuse) the hybrid; print its recall beside its MLA parent's and the GQA original's."""
    from infra.synthetic_chat import recall_items

    home = Path(args.home) if args.home else None
    items = recall_items(args.items, tiny_models.HELDOUT_SEED)
    total = time.perf_counter()
    spec = spec_for(NAME)
    scores = {}
    for name, load in ((mla_models._root_tiny(spec.parent), tiny_models.load_tiny_model),
                       (spec.parent, mla_models.load_mla_model)):
        model, tokenizer = load(name, home=home, progress=not args.quiet)
        scores[name] = tiny_models.evaluate_recall(model, tokenizer, items)["overall"]
    started = time.perf_counter()
    directory = ensure_kda_model(NAME, home=home, progress=not args.quiet)
    built = time.perf_counter() - started
    build = json.loads((directory / tiny_models.BUILD_FILE).read_text())
    model, tokenizer = load_kda_model(NAME, home=home)
    score = tiny_models.evaluate_recall(model, tokenizer, items)["overall"]
    extras = "  ".join(f"{key}={build[key]}" for key in ("train_seconds", "kl_converted", "kl_aligned", "kl_distilled"))
    others = ", ".join(f"{name} {value:.3f}" for name, value in scores.items())
    print(f"{NAME}: ensure {built:.1f}s  recall={score:.3f} vs {others} (n={len(items)})  {extras}  [{directory}]")
    print(f"total wall time (build + eval): {time.perf_counter() - total:.1f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m infra.kda_models build``."""
    parser = tiny_models.build_arguments("infra.kda_models", __doc__, "build (or reuse) kvlingo-tiny-kda and report recall",
                                         items=60)
    return _cli_build(parser.parse_args(argv))

if __name__ == "__main__":
    from infra.settings import apply_offline_defaults

    apply_offline_defaults()
    sys.exit(main())
