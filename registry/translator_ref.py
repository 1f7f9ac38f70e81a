"""One way to name a translator, everywhere a command takes one (`eval`, `bench speed`, `bench step`,
`bench multiturn`): a reference `PATH | models:/NAME@ALIAS | models:/NAME/VERSION | runs:/RUN_ID/PATH | identity`.

- `identity`: no maps; the source cache is read as it is (only between copies of one model);
- `PATH`: a translator artifact directory (`manifest.json` + `weights.safetensors`), e.g. a fit's
  `closed_form/` or `distilled/`;
- `models:/…`, `runs:/…`: a translator registered or logged in the MLflow store (`registry.tracking`).

`parse_translator_ref` validates the text without loading anything (usable in a preflight);
`load_translator_ref` loads it for a loaded pair, refusing an artifact fitted for other models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from translators.errors import ConfigError

IDENTITY = "identity"
FORMS = "PATH (a translator artifact directory), models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH or identity"
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[1-9][0-9]*))$")
_RUNS_URI = re.compile(r"^runs:/(?P<run>[0-9a-zA-Z_-]+)/(?P<path>\S+)$")


@dataclass(frozen=True)
class TranslatorRef:
    """A validated translator reference.

    Attributes:
        kind: "identity" | "path" | "registry" (a models:/ or runs:/ URI).
        text: the reference as given (stripped).
        path: the artifact directory for kind "path", else None.
    """

    kind: Literal["identity", "path", "registry"]
    text: str
    path: Path | None = None

    @property
    def label(self) -> str:
        """A short name for tables and condition names: "identity", the URI, or the artifact directory's name."""
        return (self.path.name or self.text) if self.path is not None else self.text


def parse_translator_ref(text: str) -> TranslatorRef:
    """Validate a translator reference (see the module docstring); nothing is loaded or downloaded.

    Raises:
        ConfigError: an empty reference, a malformed models:/ or runs:/ URI, a path that does not exist or is
            not a translator artifact (the message names the accepted forms and, for a fit directory, the
            artifact inside it).
    """
    text = str(text).strip()
    if not text:
        raise ConfigError(f"empty translator reference: give {FORMS}")
    if text == IDENTITY:
        return TranslatorRef("identity", text)
    if text.startswith("models:"):
        return _registry_ref(text, _MODELS_URI, "models:/NAME@ALIAS or models:/NAME/VERSION (e.g. models:/a--b@champion)")
    if text.startswith("runs:"):
        return _registry_ref(text, _RUNS_URI, "runs:/RUN_ID/PATH (e.g. runs:/0123abcd/translators/distilled)")
    if "://" in text:
        raise ConfigError(f"translator {text!r}: unsupported URI scheme; give {FORMS}")
    return TranslatorRef("path", text, _artifact_dir(Path(text).expanduser()))


def _registry_ref(text: str, pattern: re.Pattern, form: str) -> TranslatorRef:
    """A models:/ or runs:/ reference, or ConfigError naming the expected form."""
    if not pattern.match(text):
        raise ConfigError(f"translator {text!r} is not a valid registry URI: expected {form}")
    return TranslatorRef("registry", text)


def _artifact_dir(path: Path) -> Path:
    """`path` when it is a translator artifact directory, else ConfigError saying what is there instead."""
    if not path.exists():
        raise ConfigError(f"translator {str(path)!r}: no such directory; give {FORMS}")
    if not (path / "manifest.json").is_file():
        inside = [stage for stage in ("distilled", "closed_form") if (path / stage / "manifest.json").is_file()]
        hint = (f"; it is a fit directory: pass {path / inside[0]}" if inside else
                "; pass a fit's closed_form/ or distilled/ directory")
        raise ConfigError(f"translator {str(path)!r} is not a translator artifact (no manifest.json){hint}")
    return path


def load_translator_ref(ref: TranslatorRef, source_loaded: Any, target_loaded: Any):
    """The translator `ref` names, verified against the loaded pair and moved to the target's device.

    Args:
        source_loaded, target_loaded: `infra.zoo.LoadedModel` of the pair.
    Returns:
        A `translators.translator.Translator`, None for the identity, or for a pair with a hybrid side (recurrent
        states) a `translators.hybrid.HybridTranslator`.
    Raises:
        PairMismatchError: an artifact fitted for other models (the differing field is named), shapes that do not
            fit, or the identity between models whose caches differ.
        ArtifactError: a tampered or corrupt artifact. RegistryError: a URI that names nothing in the store.
        ConfigError: an identity or registry reference for a hybrid pair (its translators are read from their
            fit directory).
    """
    from translators.layout import is_hybrid
    from translators.switch import check_translator_fits

    if is_hybrid(source_loaded.layout) or is_hybrid(target_loaded.layout):
        from infra.pairs import load_hybrid_for_pair

        if ref.kind != "path":
            raise ConfigError(f"{ref.text}: hybrid translators are read from an artifact directory (a `kvlingo fit` "
                              f"run's closed_form/ or distilled/); pass its path or the fit directory")
        return load_hybrid_for_pair(ref.path, source_loaded, target_loaded)
    if ref.kind == "identity":
        check_translator_fits(None, source_loaded.layout, target_loaded.layout)
        return None
    if ref.kind == "path":
        from infra.pairs import load_for_pair

        return load_for_pair(ref.path, source_loaded, target_loaded)
    from infra.zoo import model_signature
    from registry.tracking import load_translator_uri

    from translators.token_identity import attach_token_identity

    translator, _manifest = load_translator_uri(ref.text, model_signature(source_loaded), model_signature(target_loaded))
    check_translator_fits(translator, source_loaded.layout, target_loaded.layout)
    translator.to(target_loaded.model.device)
    return attach_token_identity(translator, source_loaded.model, source_loaded.layout, target_loaded.model)
