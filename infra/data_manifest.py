"""Frozen data manifests: which conversations a fit trained and validated on, by content hash.

A manifest lists the sha256 of every training and validation conversation (or text document) in the order the
fit used them, the hash of each set as a whole, and the hash of the token ids actually fed to the models. It is
written into the run directory, the MLflow run and both translator manifests, and `conversations_from_manifest`
rebuilds the same conversations from the manifest and a source. Rankings compare runs only when their
`val_set_sha256` is equal: a validation KL on other conversations is another measurement.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from infra.conversations import Corpus, TextDocument, load_conversations
from infra.fingerprint import canonical_hash
from translators.errors import ConfigError


def item_sha256(item: Any) -> str:
    """Content hash of one conversation (list of {"role", "content"}) or text document."""
    return canonical_hash(item.text if isinstance(item, TextDocument) else [dict(m) for m in item])


def samples_sha256(samples: Sequence[Any]) -> str:
    """Hash of the token ids of samples (same-tokenizer or cross-tokenizer), in order: what the models actually read."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.fingerprint_bytes() + b";")
    return h.hexdigest()


def build_manifest(corpus: Corpus, train: Sequence[Any], val: Sequence[Any]) -> dict[str, Any]:
    """The manifest of a split; `train`/`val` are `infra.samples.Sample`s indexing `corpus.items`."""
    train_items = [item_sha256(corpus.items[i]) for i in _conversations(train)]
    val_items = [item_sha256(corpus.items[i]) for i in _conversations(val)]
    manifest = {
        "source": corpus.source,
        "kind": corpus.kind,
        "train": train_items,
        "val": val_items,
        "train_set_sha256": canonical_hash(train_items),
        "val_set_sha256": canonical_hash(val_items),
        "train_samples_sha256": samples_sha256(train),
        "val_samples_sha256": samples_sha256(val),
    }
    manifest["manifest_sha256"] = canonical_hash(manifest)
    return manifest


def _conversations(samples: Sequence[Any]) -> list[int]:
    """Distinct conversation indices of `samples`, in first-use order."""
    return list(dict.fromkeys(s.conversation for s in samples))


def conversations_from_manifest(manifest: dict[str, Any], source: str | None = None, *, seed: int = 0) -> dict[str, list]:
    """Rebuild {"train": [...], "val": [...]} conversations of a manifest from `source` (default: its own).

    Raises:
        ConfigError: the manifest is malformed, or the source lacks conversations it lists (with the count).
    """
    missing_keys = [k for k in ("source", "train", "val") if k not in manifest]
    if missing_keys:
        raise ConfigError(f"not a data manifest: missing {', '.join(missing_keys)}")
    corpus = load_conversations(source or manifest["source"], seed=seed)
    by_hash = {item_sha256(item): item for item in corpus.items}
    out: dict[str, list] = {}
    for side in ("train", "val"):
        absent = [h for h in manifest[side] if h not in by_hash]
        if absent:
            raise ConfigError(f"{len(absent)} of {len(manifest[side])} {side} conversations of the manifest are not in "
                              f"{source or manifest['source']!r} (first missing sha256 {absent[0][:12]}); "
                              "pass the source the fit was made from")
        out[side] = [by_hash[h] for h in manifest[side]]
    return out
