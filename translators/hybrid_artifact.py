"""Hybrid translator artifacts: `weights.safetensors` + `manifest.json`, as `translators.artifact` (never pickle).

A `translators.hybrid.HybridTranslator` is rebuilt from its manifest: the state strategy of each target linear
layer, the capture point, the replay maps' ν and the token-identity variant (whose module, the target's embedding
and the source's codebook, is rebuilt for the loaded pair with `translators.hybrid.attach_token_identity`, never
saved); the layer assignments are recomputed from the loaded pair's layouts and must equal the recorded ones. Loading verifies the weights' sha256 and refuses a translator fitted
for another pair, naming the first field of the model signatures that differs.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save
from torch import nn

from translators.artifact import (
    MANIFEST,
    WEIGHTS,
    ArtifactError,
    check_signature,
    read_manifest,
    replace_file,
    verified_weights,
)
from translators.hybrid import HybridTranslator, make_translator
from translators.layout import CacheLayout

FORMAT = "kvlingo.hybrid_translator.v1"


def _structure(translator: HybridTranslator) -> dict[str, Any]:
    """What the manifest records of a translator's structure (JSON keys are strings)."""
    replay = translator.replay
    return {
        "point": translator.point,
        "strategies": {str(t): s for t, s in translator.states.strategies.items()},
        "attention_assignment": {str(t): s for t, s in translator.attention_assignment.items()},
        "state_assignment": {str(t): s for t, s in translator.states.assignment.items()},
        "replay_sources": {} if replay is None else {str(t): list(s) for t, s in replay.sources.items()},
    }


def save_hybrid_translator(translator: HybridTranslator, directory: str | Path, *, source: dict[str, Any],
                           target: dict[str, Any], fit: dict[str, Any]) -> Path:
    """Write the translator and its manifest into ``directory`` (created). Returns the directory.

    Args:
        source, target: model signatures (`infra.zoo.model_signature`).
        fit: how it was fitted (stage, strategies scored, metrics...), JSON-able.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().cpu().contiguous() for name, p in translator.state_dict().items()}
    weights = save(tensors, metadata={"format": FORMAT})
    replay = translator.replay
    manifest = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **_structure(translator),
        "replay_nu": None if replay is None else len(next(iter(replay.sources.values()))),
        "token_identity": translator.token_identity,
        "pair": {"source": source, "target": target},
        "fit": fit,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
    }
    replace_file(directory / WEIGHTS, weights)  # weights first, then the manifest that vouches for them
    replace_file(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return directory


def load_hybrid_translator(directory: str | Path, source_layout: CacheLayout, target_layout: CacheLayout,
                           target_model: nn.Module, *, source: dict[str, Any] | None = None,
                           target: dict[str, Any] | None = None) -> tuple[HybridTranslator, dict[str, Any]]:
    """Load and verify a hybrid translator artifact for the loaded pair (with token identity, attach its module
    before use: `translators.hybrid.attach_token_identity`).

    Args:
        source_layout, target_layout, target_model: the pair it is used with (the replay maps' width is the
            target's ``hidden_size``).
        source, target: signatures of those models; each given one must match the recorded one.
    Raises:
        ArtifactError: missing files, another format (GQA/MLA translators load with
            `translators.artifact.load_translator`), weights whose sha256 differs from the manifest, or layer
            assignments that differ from the recorded ones.
        PairMismatchError: the artifact was fitted for another source or target (the field is named).
    """
    manifest = read_manifest(directory, FORMAT)
    weights = verified_weights(directory, manifest)
    for role, given in (("source", source), ("target", target)):
        if given is not None:
            check_signature(manifest["pair"][role], given, role)
    strategies = {int(t): s for t, s in manifest["strategies"].items()}
    translator = make_translator(source_layout, target_layout, target_model, strategies, manifest["point"],
                                 manifest["replay_nu"], manifest["token_identity"])
    rebuilt = _structure(translator)
    recorded = {key: manifest[key] for key in rebuilt}
    if rebuilt != recorded:
        raise ArtifactError(f"{directory}: the loaded pair assigns layers differently from the artifact "
                            f"(recorded {recorded}, rebuilt {rebuilt})")
    tensors = load_file(str(weights))
    expected = translator.state_dict()
    if set(tensors) != set(expected):
        raise ArtifactError(f"{weights}: tensors {sorted(tensors)} do not match the manifest's structure "
                            f"{sorted(expected)}")
    translator.load_state_dict(tensors)
    return translator, manifest
