"""The embedded default model pair ``kvlingo-tiny-s`` / ``kvlingo-tiny-l``.

Two small Qwen3-architecture causal LMs sharing one byte-level BPE tokenizer, with different depth,
width and KV-head count, trained by the platform itself on first use from the synthetic chat
corpus of :mod:`infra.synthetic_chat`. Builds are deterministic (fixed seeds, fp32) and cached under
``kvlingo_home()/models/<name>/`` next to a ``kvlingo_build.json`` recording the build-recipe hash;
a cache whose hash matches is returned without retraining.

``python -m infra.tiny_models build`` builds both and prints their held-out recall accuracies.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.settings import kvlingo_home
from infra.synthetic_chat import (
    KINDS,
    EvalItem,
    answer_chance,
    generate_conversations,
    generate_repeat_drills,
    recall_items,
)
from translators.errors import ConfigError

# Bump when the training code or the corpus generator changes behaviour: it invalidates caches.
RECIPE_VERSION = 1
BUILD_FILE = "kvlingo_build.json"
TOKENIZER_DIR = "kvlingo-tiny-tokenizer"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen3-style template: one `<|im_start|>role\ncontent<|im_end|>\n` block per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS_SEED = 0  # training stream of infra.synthetic_chat; both models see the same corpus
HELDOUT_SEED = 0  # held-out stream (disjoint from training by construction of the item seeds)
# Words and punctuation runs keep one trailing space; digit runs and other whitespace stand alone.
PRETOKEN_PATTERN = r"\p{L}+ ?|\p{N}+|[^\s\p{L}\p{N}]+ ?|\s+"
TOKENIZER_RECIPE = {"vocab_size": 2048, "corpus_conversations": 4000, "corpus_seed": CORPUS_SEED,
                    "pretokenizer": PRETOKEN_PATTERN}


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture and training recipe of one tiny model."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    warmup_frac: float = 0.05
    weight_decay: float = 0.05
    answer_weight: float = 1.0
    context_weight: float = 0.25
    drill_steps: int = 0
    drill_batch_size: int = 16
    drill_seq_len: int = 128


TINY_MODELS: dict[str, TinyModelSpec] = {
    "kvlingo-tiny-s": TinyModelSpec(
        num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=384, steps=150, batch_size=16, seq_len=512, lr=3e-3,
        seed=1,
    ),
    "kvlingo-tiny-l": TinyModelSpec(
        num_hidden_layers=6, hidden_size=192, num_attention_heads=6, num_key_value_heads=3,
        head_dim=32, intermediate_size=512, steps=150, batch_size=16, seq_len=512, lr=2e-3,
        seed=2,
    ),
}


# --- Recipe hashing and cache layout ------------------------------------------------------------


def _spec_for(name: str) -> TinyModelSpec:
    """The spec of ``name``, or a ConfigError suggesting the nearest known name."""
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    close = difflib.get_close_matches(name, list(TINY_MODELS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"Unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}.{hint}")


def _hash(recipe: dict) -> str:
    """Stable short hash of a JSON-serialisable recipe."""
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _corpus_fingerprint() -> str:
    """Hash of a corpus sample, so that any change to the generator invalidates cached builds."""
    return _hash({"sample": generate_conversations(200, CORPUS_SEED)})


def _tokenizer_recipe() -> dict:
    """Everything that determines the shared tokenizer."""
    return {"recipe_version": RECIPE_VERSION, "corpus": _corpus_fingerprint(), **TOKENIZER_RECIPE}


def _model_recipe(name: str) -> dict:
    """Everything that determines a model build (its tokenizer included)."""
    return {"recipe_version": RECIPE_VERSION, "name": name, "spec": asdict(_spec_for(name)),
            "corpus_seed": CORPUS_SEED, "tokenizer": _tokenizer_recipe()}


def _read_build_hash(directory: Path) -> str | None:
    """The recipe hash recorded in ``directory``, or None when absent or unreadable."""
    try:
        return json.loads((directory / BUILD_FILE).read_text())["recipe_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _build_lock(models_dir: Path) -> Iterator[None]:
    """Exclusive inter-process lock over all tiny builds (they share the tokenizer and the CPUs)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _atomic_build(final: Path, recipe: dict, write) -> Path:
    """Run ``write(tmp_dir)`` into a temp dir beside ``final``, record the recipe, then rename.

    The build json is written last and the rename is atomic, so a cache directory either holds a
    complete build or does not exist; an interrupted build leaves only a ``.tmp-*`` dir we remove.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        extra = write(tmp) or {}
        info = {"recipe_hash": _hash(recipe), "recipe": recipe, **extra}
        (tmp / BUILD_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        if final.exists():  # stale build: move it aside first, rename cannot replace a directory
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{final.name}-", dir=final.parent))
            os.rename(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- Tokenizer ----------------------------------------------------------------------------------


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Python rendering identical to :data:`CHAT_TEMPLATE` (much faster for the training corpus)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _train_tokenizer():
    """Train the byte-level BPE on rendered training conversations; returns a fast HF tokenizer.

    Pre-tokens attach a space to the *preceding* word ("called ", "Biscuit", ",") and numbers
    never take a space, unlike GPT-2's leading spaces. A value then has the same tokens in the
    context ("called Biscuit,") and at the start of an answer ("Biscuit."), and every word carries
    its own separator, so copying from context is plain one-token induction for the tiny models.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_RECIPE["vocab_size"], special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    count = TOKENIZER_RECIPE["corpus_conversations"]
    conversations = (generate_conversations(count, CORPUS_SEED)
                     + generate_repeat_drills(count // 4, CORPUS_SEED))
    tokenizer.train_from_iterator([render_chat(c) + ENDOFTEXT for c in conversations], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        bos_token=None, model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _ensure_tokenizer(models_dir: Path) -> Path:
    """The shared tokenizer directory, trained once (caller holds the build lock)."""
    final = models_dir / TOKENIZER_DIR
    recipe = _tokenizer_recipe()
    if _read_build_hash(final) == _hash(recipe):
        return final
    return _atomic_build(final, recipe, _write_tokenizer)


def _write_tokenizer(out: Path) -> dict:
    """Train the tokenizer and save it into ``out``; returns extra build-json fields."""
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(out)
    return {"vocab_size": len(tokenizer)}


# --- Training -----------------------------------------------------------------------------------


def _qwen3_config(spec: TinyModelSpec, tokenizer):
    """The transformers Qwen3Config of a spec."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), bos_token_id=None,
        torch_dtype="float32")


def _packed_rows(tokenizer, conversations: list[list[dict]], rows_needed: int, seq_len: int,
                 spec: TinyModelSpec):
    """``rows_needed`` rows of whole conversations packed into ``seq_len`` tokens each.

    Returns (input_ids, position_ids, weights): int64 ids and positions, float32 per-token loss
    weights of each token as a prediction target. Positions restart at 0 for every conversation,
    which makes transformers build a block-diagonal mask: a conversation never sees another one,
    exactly as at evaluation. Padding has weight 0; rows are reused cyclically if ever short.
    """
    import torch

    texts = [render_chat(c) + ENDOFTEXT for c in conversations]
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids_of = {t: tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, "assistant")}
    rows, row = [], []
    for enc in encoded:
        ids = enc.ids[:seq_len]
        if len(row) + len(ids) > seq_len:
            rows.append(row)
            row = []
        row = row + ids
    rows.append(row)
    shape = (rows_needed, seq_len)
    input_ids = torch.full(shape, ids_of[ENDOFTEXT], dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    weights = torch.zeros(shape, dtype=torch.float32)
    for r in range(rows_needed):
        ids = rows[r % len(rows)]
        input_ids[r, : len(ids)] = torch.tensor(ids)
        position_ids[r] = _restart_positions(ids, ids_of[ENDOFTEXT], seq_len)
        weights[r, : len(ids)] = _token_weights(ids, ids_of, spec)
    return input_ids, position_ids, weights


def _training_phases(tokenizer, spec: TinyModelSpec) -> list[tuple]:
    """[(input_ids, position_ids, weights, batch_size, steps)]: repeat drills, then the chat corpus.

    The short drills come first because induction-style copying forms several times faster over
    short contexts; the chat phase then only has to learn *what* to copy.
    """
    phases = []
    if spec.drill_steps:
        rows = spec.drill_steps * spec.drill_batch_size
        # A drill renders to ~35-55 tokens; over-generate so rows are never reused.
        drills = generate_repeat_drills(rows * spec.drill_seq_len // 30 + 16, CORPUS_SEED)
        phases.append((*_packed_rows(tokenizer, drills, rows, spec.drill_seq_len, spec),
                       spec.drill_batch_size, spec.drill_steps))
    rows = spec.steps * spec.batch_size
    # Rendered conversations average ~175 tokens; over-generate so rows are never reused.
    chats = generate_conversations(rows * spec.seq_len // 140 + 16, CORPUS_SEED)
    phases.append((*_packed_rows(tokenizer, chats, rows, spec.seq_len, spec),
                   spec.batch_size, spec.steps))
    return phases


def _token_weights(ids: list[int], ids_of: dict[str, int], spec: TinyModelSpec):
    """Loss weight per token: ``answer_weight`` inside assistant turns, ``context_weight`` elsewhere.

    User turns are mostly random values nobody can predict; their gradient noise would drown the
    signal that teaches in-context retrieval, which lives in the assistant answers.
    """
    import torch

    out, in_assistant = [], False
    for i, token in enumerate(ids):
        out.append(spec.answer_weight if in_assistant else spec.context_weight)
        if token == ids_of[IM_END]:
            in_assistant = False
        # The token after `<|im_start|>assistant` is the newline; content starts after it.
        elif i >= 2 and ids[i - 2] == ids_of[IM_START] and ids[i - 1] == ids_of["assistant"]:
            in_assistant = True
    return torch.tensor(out, dtype=torch.float32)


def _restart_positions(ids: list[int], eot_id: int, length: int):
    """Position ids that restart after every end-of-text token (padding forms its own segment)."""
    import torch

    positions, pos = [], 0
    for token in ids:
        positions.append(pos)
        pos = 0 if token == eot_id else pos + 1
    positions += range(length - len(ids))
    return torch.tensor(positions, dtype=torch.long)


def _weighted_loss(model, input_ids, position_ids, weights):
    """Weighted next-token cross-entropy of one packed batch."""
    import torch

    # use_cache=False: transformers only derives the packed block mask when no cache exists.
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    target_weights = weights[:, 1:].flatten()
    return (losses * target_weights).sum() / target_weights.sum().clamp_min(1e-6)


def _batches(phases: list[tuple]) -> Iterator[tuple]:
    """(input_ids, position_ids, weights) per optimiser step, phase after phase."""
    for input_ids, position_ids, weights, batch_size, steps in phases:
        for step in range(steps):
            batch = slice(step * batch_size, (step + 1) * batch_size)
            yield input_ids[batch], position_ids[batch], weights[batch]


def _lr_at(step: int, total: int, spec: TinyModelSpec) -> float:
    """Linear warm-up then cosine decay to 10% of the peak learning rate."""
    warmup = max(1, int(total * spec.warmup_frac))
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _optimizer(model, spec: TinyModelSpec):
    """AdamW with weight decay on matrices only (not on norms' gains)."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def _progress_bar(enabled: bool, description: str, total: int):
    """A rich progress bar on stderr, or a no-op stand-in when disabled."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
    progress = Progress(*columns, console=Console(stderr=True), disable=not enabled)
    task = progress.add_task(description, total=total, loss="-")
    return progress, task


def train_tiny_model(name: str, tokenizer, *, progress: bool = True, callback=None):
    """Train ``name`` from scratch on the packed corpus and return (model, final mean loss).

    ``callback(step, model)``, if given, runs after every optimiser step (used for tuning).
    """
    import torch
    from transformers import Qwen3ForCausalLM

    spec = _spec_for(name)
    torch.manual_seed(spec.seed)
    phases = _training_phases(tokenizer, spec)
    model = Qwen3ForCausalLM(_qwen3_config(spec, tokenizer)).float()
    model.train()
    optimizer = _optimizer(model, spec)
    total = sum(phase[-1] for phase in phases)
    recent: list[float] = []
    bar, task = _progress_bar(progress, name, total)
    with bar:
        for step, (ids, pos, weights) in enumerate(_batches(phases)):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, total, spec)
            loss = _weighted_loss(model, ids, pos, weights)
            if not torch.isfinite(loss):
                raise RuntimeError(f"{name}: non-finite training loss at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            recent = (recent + [loss.item()])[-10:]
            bar.update(task, advance=1, loss=f"{sum(recent) / len(recent):.3f}")
            if callback is not None:
                callback(step, model)
    model.eval()
    return model, sum(recent) / len(recent)


def _set_generation_config(model, tokenizer) -> None:
    """Greedy decoding that stops at ``<|im_end|>`` (or ``<|endoftext|>``)."""
    from transformers import GenerationConfig

    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=eos[1], do_sample=False, max_new_tokens=64)


# --- Public entry points ------------------------------------------------------------------------


def ensure_tiny_model(name: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Directory of the built model ``name``, training it first if no matching cache exists.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. Unknown names raise :class:`ConfigError`.
    """
    _spec_for(name)
    models_dir = Path(home if home is not None else kvlingo_home()) / "models"
    final = models_dir / name
    recipe = _model_recipe(name)
    if _read_build_hash(final) == _hash(recipe):
        return final
    with _build_lock(models_dir):
        if _read_build_hash(final) == _hash(recipe):  # another process built it while we waited
            return final
        tokenizer_dir = _ensure_tokenizer(models_dir)
        return _atomic_build(final, recipe, lambda tmp: _write_model(name, tokenizer_dir, tmp,
                                                                     progress))


def _write_model(name: str, tokenizer_dir: Path, out: Path, progress: bool) -> dict:
    """Train ``name`` and save model + tokenizer into ``out``; returns extra build-json fields."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model, loss = train_tiny_model(name, tokenizer, progress=progress)
    _set_generation_config(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"train_seconds": round(time.perf_counter() - started, 1), "final_loss": round(loss, 4),
            "torch": torch.__version__, "transformers": transformers.__version__}


def evaluate_recall(model, tokenizer, items: Sequence[EvalItem], *, batch_size: int = 32,
                    max_new_tokens: int = 12) -> dict[str, float]:
    """Greedy-decode each item's answer; accuracy per kind, ``overall`` and ``chance`` estimates.

    An answer is correct when the gold answer (final period stripped) occurs in the first line
    of the generated text. ``chance`` (and ``chance_<kind>``) is the mean probability of guessing
    each gold value uniformly from the pool it was drawn from.
    """
    hits = [_generate_hits(model, tokenizer, items[i:i + batch_size], max_new_tokens)
            for i in range(0, len(items), batch_size)]
    correct = [h for chunk in hits for h in chunk]
    result: dict[str, float] = {}
    for kind in KINDS:
        picked = [i for i, item in enumerate(items) if item.kind == kind]
        if picked:
            result[kind] = sum(correct[i] for i in picked) / len(picked)
            result[f"chance_{kind}"] = sum(answer_chance(items[i].answer) for i in picked) / len(picked)
    result["overall"] = sum(correct) / len(correct) if correct else 0.0
    result["chance"] = (sum(answer_chance(i.answer) for i in items) / len(items)) if items else 0.0
    return result


def _generate_hits(model, tokenizer, items: Sequence[EvalItem], max_new_tokens: int) -> list[bool]:
    """Greedy answers for one batch (left-padded), judged against the gold answers."""
    import torch

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    prompts = [tokenizer(render_chat(i.messages, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for i in items]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = [tokenizer.convert_tokens_to_ids(IM_END), pad_id]
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return [item.answer.strip().removesuffix(".") in text.strip().split("\n")[0]
            for item, text in zip(items, texts)]


def load_tiny_model(name: str, *, home: Path | None = None, progress: bool = True):
    """(model, tokenizer) of ``name``, built on first use; the model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_tiny_model(name, home=home, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    return model, AutoTokenizer.from_pretrained(directory)


def _cli_build(args: argparse.Namespace) -> int:
    """Build both models and print held-out recall per kind plus build times."""
    home = Path(args.home) if args.home else None
    items = recall_items(args.items, HELDOUT_SEED)
    total = time.perf_counter()
    for name in TINY_MODELS:
        started = time.perf_counter()
        directory = ensure_tiny_model(name, home=home, progress=not args.quiet)
        built = time.perf_counter() - started
        model, tokenizer = load_tiny_model(name, home=home)
        scores = evaluate_recall(model, tokenizer, items)
        per_kind = "  ".join(f"{k}={scores[k]:.2f} (chance {scores[f'chance_{k}']:.4f})"
                             for k in KINDS if k in scores)
        print(f"{name}: ensure {built:.1f}s  {per_kind}  overall={scores['overall']:.2f} "
              f"(chance {scores['chance']:.4f}, n={len(items)})  [{directory}]")
    print(f"total wall time (build + eval): {time.perf_counter() - total:.1f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m infra.tiny_models build``."""
    parser = argparse.ArgumentParser(prog="python -m infra.tiny_models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) both tiny models and report recall")
    build.add_argument("--home", help="kvlingo home (default: $KVLINGO_HOME or ~/.cache/kvlingo)")
    build.add_argument("--items", type=int, default=90, help="held-out recall items to score")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    return _cli_build(args)


if __name__ == "__main__":
    sys.exit(main())
