"""What a fit costs, on paper: FLOPs, memory, bytes moved and wall time of stage 1 and stage 2 for a model pair,
from the two config.json files alone (no weights). Pure arithmetic (no torch, Ray, Prefect or MLflow): `kvlingo
plan` prints it (tasks/plan.py resolves configs and measures this machine), unit tests check it by hand.

The model (GQA decoders: Llama, Qwen3, Gemma-3, Mistral, SmolLM2; one K and one V object per layer):

- Forward FLOPs per token at mean context L (causal): 2·P_layers (P_layers = the decoder's matmul weights,
  q/k/v/o projections and the gated MLP's three matrices) plus attention scores and the weighted sum,
  4·h·d_head·ā per layer, where ā is the mean number of keys a query reads: (L+1)/2 for a global layer,
  the mean of min(i+1, W) for a sliding layer with window W. The LM head is counted per *read* position only
  (stage 1 keeps one logit row per sequence; stage 2 reads the m continuation positions).
- Capture (stage 1) per prefix token: one forward of each model.
- Gram accumulation per token and cache object (keys, values), in fp64 (`translators.gram.GramStats.accumulate`):
  2·d_src² per source-layer pair (s ≤ s') that co-occurs in a target's candidates, 2·d_src·d_tgt per
  (source, target) candidate, 2·d_tgt per target layer (the trace term). With ν = 1 relative depth that is
  d_src² per token and candidate layer (times two for the multiply-add); the default R² assignment reads every
  same-type source layer per target layer, so every source pair of a type is accumulated.
- Token identity (on by default for a same-tokenizer GQA pair) appends the target's input embedding (hidden_size
  wide, d_tok) to each source layer's features: the maps and the translation read ν·(d_src + d_tok) features.
  The Gram sums keep the embedding's terms once (`GramStats.te/ee/ey`): 2·d_tok·d_src per source layer read,
  2·d_tok² once and 2·d_tok·d_tgt per target layer, beside the sums above.
- Statistics memory: 8 bytes per entry of those sums (fp64), independent of the token count; one shard merge
  moves (writes, then reads back) one such set of sums.
- Stage-2 step (one conversation: L prefix tokens, m continuation tokens): source capture of the prefix
  (forward), the translator (2·ν·d_src·d_tgt per token, target layer and object), the target's forward over m
  tokens reading L cached positions plus its LM head on the m positions (student) and the teacher's LM head,
  and the backward pass: 2× the student forward (activation gradients through the frozen target plus the map
  gradients) and 2× the translator. The teacher's own prefill is computed once per sample and not counted.
- Wall time on G GPUs: stage-1 FLOPs split evenly over G workers, model forwards at `bf16_tflops`·`mfu`, Gram
  products at `fp64_tflops`·`gram_efficiency`; each worker merges its shards and the driver merges G partial
  sums (bytes at `merge_gb_s`); stage 2 is data parallel over the conversations of a step (at most `batch`
  workers busy) and all-reduces the map gradients (fp32) each step at `allreduce_gb_s`.

Default throughputs are an H100 SXM's dense peaks (989 TFLOP/s bf16, 67 TFLOP/s fp64 tensor cores); the
efficiency factors (MFU 0.35 for model passes at batch 1, 0.6 for large fp64 Gram products) are assumptions, to
be replaced by a measurement (`kvlingo plan --measure` checks them on this CPU for pairs it can run).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from translators.errors import ConfigError


class UnsupportedConfigError(ConfigError):
    """A config.json lacks what the cost model needs (not a GQA decoder, or missing sizes)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that its costs depend on (read from a Hugging Face config.json)."""

    name: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layer_types: tuple[str, ...]  # per layer "full_attention" | "sliding_attention"
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> ModelShape:
        """Read a config.json mapping (a multimodal config's `text_config` when present).

        Raises:
            UnsupportedConfigError: a size is missing or not a positive integer, naming the keys.
        """
        text = config.get("text_config") or config
        if "kv_lora_rank" in text:
            # An MLA cache is a latent and a rotary key, not kv_heads·head_dim keys and values: these formulas
            # would be silently wrong for it.
            raise UnsupportedConfigError(
                f"{name}: an MLA config (kv_lora_rank); the cost model reads GQA configs only. Fit the pair "
                "directly (`kvlingo fit`): its summary reports the statistics' size (stats_mb) and wall time")
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if not isinstance(text.get(k), int) or text.get(k) < 1]
        if missing:
            raise UnsupportedConfigError(
                f"{name}: config.json lacks {', '.join(missing)}; the cost model reads decoder-only (GQA) configs "
                "(Llama, Qwen3, Gemma-3, Mistral, SmolLM2 …)")
        heads = text["num_attention_heads"]
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        n = text["num_hidden_layers"]
        types = text.get("layer_types")
        window = text.get("sliding_window")
        if not types:
            types = ["full_attention"] * n
        if len(types) != n:
            raise UnsupportedConfigError(f"{name}: layer_types has {len(types)} entries for {n} layers")
        return cls(name=name, n_layers=n, hidden=text["hidden_size"], heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, intermediate=text["intermediate_size"], vocab=text["vocab_size"],
                   layer_types=tuple("sliding_attention" if t == "sliding_attention" else "full_attention" for t in types),
                   sliding_window=window if any(t == "sliding_attention" for t in types) else None)

    @property
    def kv_width(self) -> int:
        """Width of one layer's keys (= values): kv_heads · head_dim, the d of the translator's maps."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer: q, k, v, o projections and the gated MLP (3 · d · d_ff)."""
        q, kv = self.heads * self.head_dim, self.kv_width
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def decoder_params(self) -> int:
        """Matmul weights of all decoder layers (embeddings and norms excluded)."""
        return self.n_layers * self.layer_params

    @property
    def head_params(self) -> int:
        """LM head: d · V (tied or not, the product costs the same)."""
        return self.hidden * self.vocab

    def mean_keys_read(self, context: int, layer: int) -> float:
        """Mean number of keys a query of a causal sequence of `context` tokens reads in `layer`."""
        if self.layer_types[layer] == "sliding_attention" and self.sliding_window:
            w = self.sliding_window
            if context <= w:
                return (context + 1) / 2
            # positions 1..w read i keys, the remaining context - w read w
            return (w * (w + 1) / 2 + (context - w) * w) / context
        return (context + 1) / 2

    def attention_flops_per_token(self, context: int) -> float:
        """Scores (QKᵀ) and weighted sum (AV) per query token, all layers: 4·h·d_head·ā per layer."""
        return sum(4 * self.heads * self.head_dim * self.mean_keys_read(context, i) for i in range(self.n_layers))

    def forward_flops_per_token(self, context: int) -> float:
        """One decoder forward per token of a `context`-token sequence, without the LM head."""
        return 2 * self.decoder_params + self.attention_flops_per_token(context)

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        """Weights including embeddings (untied head counted once more is ignored): for GPU memory checks."""
        return (self.decoder_params + self.head_params) * bytes_per_param


def candidate_sets(source: ModelShape, target: ModelShape, assignment: str, nu: int) -> dict[int, tuple[int, ...]]:
    """The source layers whose statistics are accumulated per target layer (as `translators.stage1.candidate_layers`).

    Raises:
        ConfigError: unknown assignment, ν out of range, a target attention type the source lacks.
    """
    from translators.assignment import all_candidates, check_assignment_name, corresponding_types, relative_depth

    check_assignment_name(assignment)
    if nu < 1 or nu > source.n_layers:
        raise ConfigError(f"ν = {nu} must be between 1 and the source depth ({source.n_layers} layers)")
    types = corresponding_types(list(source.layer_types), list(target.layer_types))
    if assignment == "depth":
        return relative_depth(source.n_layers, target.n_layers, nu, *types)
    return all_candidates(source.n_layers, target.n_layers, *types)


def fit_nu(source: ModelShape, target: ModelShape, nu: int | None) -> int:
    """ν as `kvlingo fit` resolves it (`translators.stage1.default_nu`): the given one, else DEFAULT_NU capped by
    the fewest source layers of a target layer's attention type."""
    from translators.assignment import all_candidates, corresponding_types
    from translators.stage1 import DEFAULT_NU

    if nu is not None:
        return nu
    types = corresponding_types(list(source.layer_types), list(target.layer_types))
    return min(DEFAULT_NU, min(len(c) for c in all_candidates(source.n_layers, target.n_layers, *types).values()))


def gram_counts(candidates: dict[int, tuple[int, ...]]) -> dict[str, int]:
    """How many sums one cache object's statistics hold: source pairs (s ≤ s') that co-occur in a target's
    candidates (d_src × d_src each), (source, target) pairs (d_src × d_tgt each), target layers (scalars)."""
    pairs = {(a, b) for srcs in candidates.values() for a in srcs for b in srcs if a <= b}
    return {"xx": len(pairs), "xy": sum(len(s) for s in candidates.values()), "yy": len(candidates)}


@dataclass(frozen=True)
class Throughput:
    """Assumed accelerator: peak rates and the fractions reached (see the module docstring)."""

    bf16_tflops: float = 989.0
    fp64_tflops: float = 67.0
    mfu: float = 0.35
    gram_efficiency: float = 0.6
    merge_gb_s: float = 5.0
    allreduce_gb_s: float = 50.0
    gpu_memory_gb: float = 80.0
    name: str = "H100 SXM (dense peaks)"

    def __post_init__(self):
        for key in ("bf16_tflops", "fp64_tflops", "mfu", "gram_efficiency", "merge_gb_s", "allreduce_gb_s", "gpu_memory_gb"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"throughput {key} must be > 0, got {getattr(self, key)}")
        if self.mfu > 1 or self.gram_efficiency > 1:
            raise ConfigError("mfu and gram_efficiency are fractions of the peak (≤ 1)")


@dataclass(frozen=True)
class Workload:
    """What the fit reads: training tokens (prefix positions), conversation lengths, stage-2 schedule."""

    tokens: int
    prefix_tokens: int = 512
    continuation_tokens: int = 64
    assignment: str = "r2"
    nu: int | None = None  # None: `kvlingo fit`'s default for the pair (`fit_nu`)
    steps: int = 400
    batch: int = 8
    shard_samples: int = 32  # conversations per content-addressed statistics shard (tasks.fit.STATS_SHARD_SIZE)
    # Token identity appends the target's input embedding (hidden_size wide) to every source layer's features.
    # None: as `kvlingo fit`'s default (auto) decides for a same-tokenizer pair, read here as equal vocabulary sizes
    # (the tokenizers themselves are not loaded).
    token_identity: bool | None = None

    def __post_init__(self):
        for key in ("tokens", "prefix_tokens", "continuation_tokens", "nu", "steps", "batch", "shard_samples"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be ≥ 1, got {getattr(self, key)}")

    @property
    def conversations(self) -> int:
        """Training conversations holding `tokens` prefix tokens."""
        return math.ceil(self.tokens / self.prefix_tokens)

    @property
    def shards(self) -> int:
        return math.ceil(self.conversations / self.shard_samples)


@dataclass
class CostEstimate:
    """Every number `kvlingo plan` prints (FLOPs, bytes, seconds); `as_dict` is its --json shape."""

    source: str
    target: str
    gpus: int
    workload: dict[str, Any]
    throughput: dict[str, Any]
    kv_width: dict[str, int]
    candidates: dict[str, int]
    capture_flops_per_token: dict[str, float]
    gram_flops_per_token: float
    stats_bytes: int
    shards: int
    merge_bytes_per_shard: int
    stage1_flops: dict[str, float]
    stage2_step_flops: float
    stage2_flops: float
    map_params: int
    seconds: dict[str, float]
    memory_gb_per_gpu: dict[str, float]
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def map_params(source: ModelShape, target: ModelShape, nu: int, objects: int = 2, token_width: int = 0) -> int:
    """Translator parameters: per target layer and object, a d_tgt × ν·d_src map (d_src: the source's K/V width
    plus `token_width`, the target embedding token identity appends, 0 without it)."""
    return objects * target.n_layers * nu * (source.kv_width + token_width) * target.kv_width


def gram_flops_per_token(source: ModelShape, target: ModelShape, candidates: dict[int, tuple[int, ...]],
                         objects: int = 2, token_width: int = 0) -> float:
    """fp64 FLOPs of `GramStats.accumulate` per token, over all cache objects (see the module docstring;
    `token_width` as in `map_params`)."""
    c = gram_counts(candidates)
    ds, dt, dk = source.kv_width, target.kv_width, token_width
    tokens = 2 * dk * ds * _sources_read(candidates) + 2 * dk * dk + 2 * dk * dt * c["yy"]
    return objects * (2 * ds * ds * c["xx"] + 2 * ds * dt * c["xy"] + 2 * dt * c["yy"] + tokens)


def stats_bytes(source: ModelShape, target: ModelShape, candidates: dict[int, tuple[int, ...]], objects: int = 2,
                token_width: int = 0) -> int:
    """fp64 bytes of one set of statistics (what one shard stores and one merge reads; `token_width` as in
    `map_params`)."""
    c = gram_counts(candidates)
    ds, dt, dk = source.kv_width, target.kv_width, token_width
    tokens = dk * ds * _sources_read(candidates) + dk * dk + dk * dt * c["yy"]
    return objects * 8 * (ds * ds * c["xx"] + ds * dt * c["xy"] + c["yy"] + tokens)


def _sources_read(candidates: dict[int, tuple[int, ...]]) -> int:
    """Source layers some target layer reads."""
    return len({s for sources in candidates.values() for s in sources})


def token_width_of(source: ModelShape, target: ModelShape, token_identity: bool | None) -> int:
    """The width token identity appends to each source layer's features: the target's hidden size when it is on
    (None: on for equal vocabulary sizes, see `Workload.token_identity`), else 0."""
    on = source.vocab == target.vocab if token_identity is None else token_identity
    return target.hidden if on else 0


def capture_flops_per_token(model: ModelShape, prefix_tokens: int) -> float:
    """One capture forward per prefix token (one LM-head row per sequence, spread over its tokens)."""
    return model.forward_flops_per_token(prefix_tokens) + 2 * model.head_params / prefix_tokens


def stage2_sample_flops(source: ModelShape, target: ModelShape, prefix_tokens: int, continuation_tokens: int,
                        nu: int, objects: int = 2, token_width: int = 0) -> dict[str, float]:
    """FLOPs of one conversation in one stage-2 step, by part (see the module docstring; `token_width` as in
    `map_params`)."""
    L, m = prefix_tokens, continuation_tokens
    capture = L * source.forward_flops_per_token(L)
    translate = (L - 1) * objects * target.n_layers * 2 * nu * (source.kv_width + token_width) * target.kv_width
    # The student's m queries each read the L-1 injected positions plus the causal part of the continuation.
    attention = m * sum(4 * target.heads * target.head_dim * min(L - 1 + (m + 1) / 2,
                        target.sliding_window or math.inf) for _ in range(target.n_layers))
    student = m * 2 * target.decoder_params + attention + m * 2 * target.head_params
    teacher_head = m * 2 * target.head_params
    return {"capture": capture, "translate": translate, "student_forward": student, "teacher_head": teacher_head,
            "backward": 2 * student + 2 * translate}


def estimate(source: ModelShape, target: ModelShape, workload: Workload, gpus: int,
             throughput: Throughput | None = None) -> CostEstimate:
    """The cost of fitting `source` → `target` on `workload` with `gpus` workers.

    Raises:
        ConfigError: gpus < 1, a bad workload or throughput, or an assignment the pair does not allow.
    """
    if gpus < 1:
        raise ConfigError(f"gpus must be ≥ 1, got {gpus}")
    tp = throughput or Throughput()
    workload = replace(workload, nu=fit_nu(source, target, workload.nu))
    tw = token_width_of(source, target, workload.token_identity)
    workload = replace(workload, token_identity=tw > 0)
    cands = candidate_sets(source, target, workload.assignment, workload.nu)
    counts = gram_counts(cands)
    cap = {"source": capture_flops_per_token(source, workload.prefix_tokens),
           "target": capture_flops_per_token(target, workload.prefix_tokens)}
    gram = gram_flops_per_token(source, target, cands, token_width=tw)
    nbytes = stats_bytes(source, target, cands, token_width=tw)
    n = workload.tokens
    s1 = {"capture": n * (cap["source"] + cap["target"]), "gram": n * gram}
    sample = stage2_sample_flops(source, target, workload.prefix_tokens, workload.continuation_tokens, workload.nu,
                                 token_width=tw)
    step = workload.batch * sum(sample.values())
    params = map_params(source, target, workload.nu, token_width=tw)
    bf16, fp64 = tp.bf16_tflops * 1e12 * tp.mfu, tp.fp64_tflops * 1e12 * tp.gram_efficiency
    shards = workload.shards
    # Each worker sums its own shards, then the driver sums one partial per worker (tree of depth two).
    merges_on_path = math.ceil(shards / gpus) + (gpus - 1 if gpus > 1 else 0)
    seconds = {
        "stage1_capture": s1["capture"] / (gpus * bf16),
        "stage1_gram": s1["gram"] / (gpus * fp64),
        "stage1_merge": merges_on_path * 2 * nbytes / (tp.merge_gb_s * 1e9),
    }
    busy = min(gpus, workload.batch)
    seconds["stage2"] = workload.steps * (step / (busy * bf16)
                                          + (2 * 4 * params / (tp.allreduce_gb_s * 1e9) if gpus > 1 else 0.0))
    seconds["stage1"] = seconds["stage1_capture"] + seconds["stage1_gram"] + seconds["stage1_merge"]
    seconds["total"] = seconds["stage1"] + seconds["stage2"]
    weights_gb = (source.weight_bytes() + target.weight_bytes()) / 1e9
    memory = {"weights_bf16": weights_gb, "stats_fp64": nbytes / 1e9, "total": weights_gb + nbytes / 1e9}
    warnings = []
    if memory["total"] > tp.gpu_memory_gb:
        warnings.append(f"statistics ({memory['stats_fp64']:.1f} GB fp64) and weights ({weights_gb:.1f} GB) exceed "
                        f"{tp.gpu_memory_gb:g} GB per GPU: accumulate on the host, or use --assignment depth")
    if gpus > workload.batch:
        warnings.append(f"stage 2 keeps at most batch={workload.batch} workers busy; {gpus - workload.batch} GPUs idle")
    return CostEstimate(
        source=source.name, target=target.name, gpus=gpus, workload=asdict(workload), throughput=asdict(tp),
        kv_width={"source": source.kv_width, "target": target.kv_width}, candidates=counts,
        capture_flops_per_token=cap, gram_flops_per_token=gram, stats_bytes=nbytes, shards=shards,
        merge_bytes_per_shard=2 * nbytes, stage1_flops=s1, stage2_step_flops=step,
        stage2_flops=workload.steps * step, map_params=params, seconds=seconds, memory_gb_per_gpu=memory,
        warnings=warnings,
    )
