"""Plan a source/target pair of vLLM servers with the kvlingo connector (`kvlingo serve`).

Everything that needs kvlingo's own stack happens here, before an engine starts: the models are resolved and
loaded once for their signatures (the connector pins the pair with them), a registry reference is downloaded
into a local artifact directory (the connector imports no MLflow), and the translator is checked against the
pair (a mismatch is reported now, not as every request falling back).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.settings import kvlingo_home


@dataclass(frozen=True)
class EngineSpec:
    name: str
    model_dir: str
    kv_role: str
    extra: dict[str, Any]  # kv_connector_extra_config


def plan_servers(source: str, target: str, translator: str, store: Path | None = None,
                 max_prefix_tokens: int | None = None,
                 reverse_translator: str | None = None) -> tuple[EngineSpec, EngineSpec]:
    """The source and target engines.

    With `translator` only, the source engine is a producer (it saves every prompt's K/V) and the target a
    consumer. With `reverse_translator` (TARGET → SOURCE) too, both engines save and load (`kv_both`), so a
    conversation can switch back and forth; on a switch back, an engine reuses its own earlier rows and
    translates only the span the other model wrote.

    Raises:
        ConfigError: a malformed translator reference or a bad max_prefix_tokens; UnknownModelError /
            ModelUnavailableError: a model that cannot be resolved; PairMismatchError: an artifact fitted for
            another pair, or the identity between different models; RegistryError: a URI naming nothing.
    """
    from infra.zoo import load_model, model_signature
    from registry.translator_ref import parse_translator_ref
    from translators.errors import ConfigError

    forward = parse_translator_ref(translator)  # malformed references are reported before any model loads
    backward = parse_translator_ref(reverse_translator) if reverse_translator is not None else None
    if max_prefix_tokens is not None and max_prefix_tokens < 1:
        raise ConfigError(f"--max-prefix-tokens must be positive, got {max_prefix_tokens}")
    src, tgt = load_model(source, device="cpu"), load_model(target, device="cpu")
    src_sig, tgt_sig = model_signature(src), model_signature(tgt)
    path = _served_path(forward, src, tgt, src_sig, tgt_sig, max_prefix_tokens)
    store = Path(store) if store is not None else kvlingo_home() / "serving" / "conversations"
    extra = {"store": str(store)}
    if max_prefix_tokens is not None:
        extra["max_prefix_tokens"] = max_prefix_tokens
    source_extra = {"store": str(store), "model_signature": src_sig}
    source_role, target_role = "kv_producer", "kv_consumer"
    if backward is not None:
        reverse = _served_path(backward, tgt, src, tgt_sig, src_sig, max_prefix_tokens, "--reverse-translator")
        source_extra = {**extra, "model_signature": src_sig, "translator": reverse}
        source_role = target_role = "kv_both"
    producer = EngineSpec(src.name, src.model.config._name_or_path, source_role, source_extra)
    consumer = EngineSpec(tgt.name, tgt.model.config._name_or_path, target_role,
                          {**extra, "model_signature": tgt_sig, "translator": path})
    return producer, consumer


def _served_path(ref, src, tgt, src_sig: dict, tgt_sig: dict, max_prefix_tokens: int | None,
                 option: str = "--translator") -> str:
    """A parsed translator reference (SRC → TGT) as the connector takes it: "identity" or a local artifact directory,
    checked against the pair.

    Raises:
        ConfigError, PairMismatchError, RegistryError: see `plan_servers`.
    """
    from infra.serving import serve_translator
    from translators.artifact import check_signature
    from translators.errors import PairMismatchError

    if ref.kind == "identity":
        try:  # identity: the target reads its own model's cache
            check_signature(tgt_sig, src_sig, "source")
        except PairMismatchError as err:
            raise PairMismatchError(f"{option} identity serves a model's cache to the same model, but {src.name!r} "
                                    f"and {tgt.name!r} differ ({_which(err)}); "
                                    "give a translator fitted for the pair") from None
        path = "identity"
    elif ref.kind == "path":
        path = str(ref.path.resolve())
    else:
        from registry.tracking import fetch_translator

        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in ref.text)
        path = str(fetch_translator(ref.text, kvlingo_home() / "serving" / "translators" / safe))
    served = serve_translator(path, tgt.layout, tgt_sig, max_prefix_tokens)
    check_signature(served.source, src_sig, "source")
    return path


def _which(err: Exception) -> str:
    """The differing field of a signature mismatch, worded for two models rather than an artifact and a model."""
    field = str(err).split(": ", 1)[-1].split(". Fit", 1)[0]
    return field.replace("source.", "", 1).replace(" in the artifact but ", " for the target but ").replace(
        " for the loaded model", " for the source")
