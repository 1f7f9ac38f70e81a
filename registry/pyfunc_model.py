"""The MLflow pyfunc wrapper of a translator artifact.

The pickled part of the model is this class with an empty state: the weights travel as the artifact
directory (`weights.safetensors` + `manifest.json`, attached under the name `translator`) and are loaded,
with their sha256 verified, in `load_context`. Loading needs kvlingo importable (`translators`, `registry`).

This module imports MLflow: kvlingo imports it only after `infra.settings.apply_offline_defaults` (MLflow
reads its telemetry switch on import); import it directly only after calling that yourself.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc

from translators.errors import ConfigError

ARTIFACT_KEY = "translator"


class TranslatorModel(mlflow.pyfunc.PythonModel):
    """`predict(None)` (or `{}`) returns the manifest summary; `predict({"keys": [...], "values": [...]})`
    translates a source capture: lists indexed by source layer of [n_tokens, d_src] arrays, answered with
    `{"keys": [...], "values": [...]}` lists over target layers of [n_tokens, d_tgt] float32 numpy arrays."""

    # MLflow would wrap `predict` for type-hint validation and warn that it has no hints; the input is a
    # plain dict of arrays that `predict` checks itself. (An MLflow hook; if it goes away, only the warning
    # comes back.)
    _skip_type_hint_validation = True

    def __init__(self) -> None:
        # Nothing but None here: the instance is pickled when the model is logged.
        self._translator = None
        self._manifest: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Never pickle tensors, even if someone logs an instance that has already loaded its context.
        return {**self.__dict__, "_translator": None, "_manifest": None}

    def load_context(self, context) -> None:
        """Raises ArtifactError when the attached weights do not match their manifest's sha256."""
        from translators.artifact import load_translator

        self._translator, self._manifest = load_translator(context.artifacts[ARTIFACT_KEY])

    def predict(self, context, model_input, params=None):
        """Raises:
            ConfigError: input that is neither empty nor a {"keys", "values"} capture, or misses source layers.
        """
        if model_input is None or (isinstance(model_input, dict) and not model_input):
            return manifest_summary(self._manifest)
        if not isinstance(model_input, dict) or set(model_input) != {"keys", "values"}:
            raise ConfigError(
                "translator models take None (manifest summary) or {'keys': [...], 'values': [...]}, lists "
                "indexed by source layer of [n_tokens, d_src] arrays"
            )
        return translate_arrays(self._translator, model_input["keys"], model_input["values"])


def manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """The user-facing fields of a manifest (pair names, stage, point, dims, assignment, validation KL)."""
    fit = manifest.get("fit", {})
    return {
        "source": manifest["pair"]["source"].get("name"),
        "target": manifest["pair"]["target"].get("name"),
        "stage": fit.get("stage"),
        "point": manifest["point"],
        "d_src": manifest["d_src"],
        "d_tgt": manifest["d_tgt"],
        "assignment": manifest["assignment"],
        "val_kl": fit.get("val_kl"),
        "weights_sha256": manifest["weights_sha256"],
    }


def translate_arrays(translator, keys, values) -> dict[str, list]:
    """Translate per-source-layer arrays with a loaded Translator; returns numpy arrays per target layer.

    Raises:
        ConfigError: fewer source layers than the assignment reads, or a width other than d_src.
    """
    import torch

    needed = max(translator.source_layers()) + 1
    converted = {}
    for side, layers in (("keys", keys), ("values", values)):
        if len(layers) < needed:
            raise ConfigError(f"{side}: the translator reads source layers up to {needed - 1}, got {len(layers)} layers")
        tensors = [torch.as_tensor(x, dtype=torch.float32) for x in layers]  # each [n_tokens, d_src]
        widths = {int(t.shape[-1]) for t in tensors}
        if widths != {translator.d_src}:
            raise ConfigError(f"{side}: expected width d_src={translator.d_src}, got {sorted(widths)}")
        converted[side] = tensors
    with torch.no_grad():
        out_keys, out_values = translator(converted["keys"], converted["values"])
    return {"keys": [k.numpy() for k in out_keys], "values": [v.numpy() for v in out_values]}
