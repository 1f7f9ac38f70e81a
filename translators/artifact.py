"""Translator artifacts: `weights.safetensors` + `manifest.json` (never pickle).

The manifest carries a compatibility signature of the model pair (names, weight identities, config and
tokenizer hashes, cache layouts), the capture point, the assignment, the dimensions and the sha256 of the
weights. Loading verifies the weights' hash and, when the caller passes the loaded pair's signatures,
refuses a translator fitted for another pair, naming the first field that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save

from translators.errors import KvlingoError, PairMismatchError
from translators.translator import Translator

FORMAT = "kvlingo.translator.v1"
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"


class ArtifactError(KvlingoError):
    """An artifact directory is missing files, tampered with, or of an unknown format."""


def save_translator(
    translator: Translator, directory: str | Path, *, source: dict[str, Any], target: dict[str, Any], fit: dict[str, Any]
) -> Path:
    """Write the translator and its manifest into `directory` (created). Returns the directory.

    Args:
        source, target: model signatures (`infra.zoo.model_signature`).
        fit: how it was fitted (stage, assignment method, ν, ridge, metrics...), JSON-able.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().cpu().contiguous() for name, p in translator.maps.items()}
    weights = save(tensors, metadata={"format": FORMAT})
    manifest = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "point": translator.point,
        "d_src": translator.d_src,
        "d_tgt": translator.d_tgt,
        "assignment": {name: {str(t): list(s) for t, s in translator.assignment[name].items()} for name in translator.objects},
        "pair": {"source": source, "target": target},
        # Only across cache kinds (GQA ↔ MLA); a map that reads its own object needs no entry.
        **({} if translator.reads_own_objects else {"inputs": {name: list(v) for name, v in translator.inputs.items()}}),
        # How token ids are obtained when the maps append token identity (the module is rebuilt for the pair).
        **({} if translator.token_identity is None else {"token_identity": translator.token_identity}),
        "fit": fit,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
    }
    # Weights first, then the manifest that vouches for them; each file is replaced whole, so two processes
    # saving the same translator (concurrent sweeps) or a reader never see a half-written file.
    replace_file(directory / WEIGHTS, weights)
    replace_file(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return directory


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it onto `path` (atomic on one filesystem)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp")  # unique per writer
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(directory: str | Path, expected: str = FORMAT) -> dict[str, Any]:
    """The manifest of an artifact directory of format ``expected``.

    Raises:
        ArtifactError: missing or unreadable manifest, or another format.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a translator artifact: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != expected:
        raise ArtifactError(f"{path}: unknown artifact format {manifest.get('format')!r} (expected {expected})")
    return manifest


def verified_weights(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """The weights file of an artifact directory, after checking its sha256 against the manifest.

    Raises:
        ArtifactError: the file is missing, or its hash differs (modified or corrupted).
    """
    weights = Path(directory) / WEIGHTS
    if not weights.is_file():
        raise ArtifactError(f"{directory}: {WEIGHTS} is missing")
    digest = _sha256(weights)
    if digest != manifest["weights_sha256"]:
        raise ArtifactError(
            f"{weights} has sha256 {digest[:16]}… but the manifest records {manifest['weights_sha256'][:16]}…: "
            "the file was modified or corrupted; re-download or re-fit the translator"
        )
    return weights


def load_translator(
    directory: str | Path, *, source: dict[str, Any] | None = None, target: dict[str, Any] | None = None
) -> tuple[Translator, dict[str, Any]]:
    """Load and verify a translator artifact.

    Args:
        source, target: signatures of the models it will be used with; each given one must match.
    Raises:
        ArtifactError: missing files or weights whose sha256 differs from the manifest (tampered/corrupt).
        PairMismatchError: the artifact was fitted for another source or target (the field is named).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    weights = verified_weights(directory, manifest)
    for role, given in (("source", source), ("target", target)):
        if given is not None:
            check_signature(manifest["pair"][role], given, role)
    # One entry per cache object (GQA: "keys", "values"); the maps are named `<object>_<target layer>`.
    assignment = {name: {int(t): tuple(s) for t, s in layers.items()} for name, layers in manifest["assignment"].items()}
    translator = Translator(assignment, manifest["d_src"], manifest["d_tgt"], manifest["point"], manifest.get("inputs"),
                            manifest.get("token_identity"))
    tensors = load_file(str(weights))
    if set(tensors) != set(translator.maps):
        raise ArtifactError(f"{weights}: tensors {sorted(tensors)} do not match the manifest's assignment")
    for name, value in tensors.items():
        translator.maps[name].data.copy_(value)
    return translator, manifest


def check_signature(recorded: dict[str, Any], given: dict[str, Any], role: str) -> None:
    """Raises PairMismatchError naming the first differing field of two model signatures."""
    difference = _first_difference(recorded, given, role)
    if difference:
        raise PairMismatchError(
            f"this translator was fitted for another {role} model: {difference}. Fit a translator for this pair "
            f"(`kvlingo fit`) or load the model it was made for ({recorded.get('name')!r})."
        )


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key} is {'missing from the artifact' if key not in a else 'missing from the model'}"
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    return None if a == b else f"{path} is {_short(a)} in the artifact but {_short(b)} for the loaded model"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "…"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
