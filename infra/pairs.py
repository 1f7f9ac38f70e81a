"""Checks on a (source, target) pair, and loading a translator artifact for a loaded pair."""

from __future__ import annotations

from pathlib import Path

from infra.zoo import LoadedModel, model_signature
from translators.errors import PairMismatchError
from translators.translator import Translator


def same_tokenizer(source: LoadedModel, target: LoadedModel) -> bool:
    """Whether the pair shares token ids position for position (else it needs the cross-tokenizer alignment)."""
    if source.identity["tokenizer_sha256"] == target.identity["tokenizer_sha256"]:
        return True
    return source.tokenizer.get_vocab() == target.tokenizer.get_vocab()  # only normalisation metadata differs


def check_same_tokenizer(source: LoadedModel, target: LoadedModel) -> None:
    """For commands that read token ids shared by both models (bench step): refuse a pair
    whose tokenizers differ, naming the difference and the commands that align such pairs.

    Raises:
        PairMismatchError: vocabularies (or their ids) differ.
    """
    if source.identity["tokenizer_sha256"] == target.identity["tokenizer_sha256"]:
        return
    src_vocab, tgt_vocab = source.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if src_vocab == tgt_vocab:
        return  # same ids; only normalisation metadata differs
    only_src = sorted(set(src_vocab) - set(tgt_vocab))[:3]
    only_tgt = sorted(set(tgt_vocab) - set(src_vocab))[:3]
    moved = sorted(t for t in set(src_vocab) & set(tgt_vocab) if src_vocab[t] != tgt_vocab[t])[:3]
    details = [f"vocabulary sizes {len(src_vocab)} vs {len(tgt_vocab)}"]
    if only_src:
        details.append(f"only in {source.name}: {only_src}")
    if only_tgt:
        details.append(f"only in {target.name}: {only_tgt}")
    if moved:
        details.append(f"tokens with different ids: {moved}")
    raise PairMismatchError(
        f"{source.name} and {target.name} use different tokenizers ({'; '.join(details)}). This command needs a "
        "shared tokenizer; pairs that tokenize differently are aligned by `kvlingo fit`, `kvlingo eval` "
        "(--benchmark needle_codes / xquad_multiturn), `kvlingo bench speed` and `kvlingo bench multiturn`. Pick a pair from one model family."
    )


def load_for_pair(path: str | Path, source: LoadedModel, target: LoadedModel) -> Translator:
    """Load a translator artifact for this loaded pair, refusing one fitted for other models.

    The manifest's pair signature is checked against both models' signatures (names, weight identities,
    config and tokenizer hashes, cache layouts), then the maps' shapes against the layouts.

    Raises:
        ArtifactError: not an artifact, or tampered/corrupt weights.
        PairMismatchError: fitted for another source or target (the differing field is named), or shapes that
            do not fit.
    """
    from translators.artifact import load_translator
    from translators.switch import check_translator_fits
    from translators.token_identity import attach_token_identity

    translator, _manifest = load_translator(path, source=model_signature(source), target=model_signature(target))
    check_translator_fits(translator, source.layout, target.layout)
    translator.to(target.model.device)
    return attach_token_identity(translator, source.model, source.layout, target.model)


def load_hybrid_for_pair(path: str | Path, source: LoadedModel, target: LoadedModel):
    """Load a hybrid translator artifact (`kvlingo fit` of a pair with a hybrid side) for this loaded pair, with
    its token-identity module attached; refuses one fitted for other models.

    Returns:
        a `translators.hybrid.HybridTranslator`.
    Raises:
        ArtifactError, PairMismatchError: see `translators.hybrid_artifact.load_hybrid_translator`.
    """
    from translators.hybrid import attach_token_identity
    from translators.hybrid_artifact import load_hybrid_translator

    translator, _ = load_hybrid_translator(path, source.layout, target.layout, target.model,
                                           source=model_signature(source), target=model_signature(target))
    return attach_token_identity(translator, source.model, source.layout, target.model)
