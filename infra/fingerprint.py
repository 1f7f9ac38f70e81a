"""The run fingerprint: one canonical hash of everything that can change a fit's result.

It keys the default run directory, stage-2 checkpoints (resume only on an identical fingerprint), sweep cells
and registry tags. Its fields are

- every `FitConfig` field except those in `NON_RESULT_FIELDS` (where output goes, how many workers on which
  devices, how often to log): a field added to the config later is part of the fingerprint unless it is listed there;
- the exact signatures of both models (`infra.zoo.model_signature`: weight identity, config, tokenizer, layout);
- the hash of the data manifest (`infra.data_manifest`): which conversations trained and validated.

Workers are excluded on purpose: one process and W Ray workers follow the same trajectory bit for bit
(tests/integration/test_ray_distill.py), so a run may resume on another worker count.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Config fields that change where or how a run reports, never what it computes.
NON_RESULT_FIELDS = frozenset(
    {"output_dir", "workers", "gpu", "ray_address", "eval_every", "checkpoint_every", "stage1_only", "resume", "seeds"}
)


def canonical_hash(value: Any) -> str:
    """sha256 of the canonical JSON of `value` (sorted keys, no whitespace, non-JSON values as str)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint_fields(config: Mapping[str, Any], signatures: Mapping[str, Any], data_manifest_sha256: str) -> dict[str, Any]:
    """The fields the fingerprint hashes. `config` is a FitConfig dumped with `model_dump(mode="json")`."""
    return {
        "config": {k: v for k, v in sorted(config.items()) if k not in NON_RESULT_FIELDS},
        "source": signatures["source"],
        "target": signatures["target"],
        "data_manifest_sha256": data_manifest_sha256,
    }


def fingerprint(fields: Mapping[str, Any]) -> str:
    """The run fingerprint (hex sha256) of `fingerprint_fields(...)`."""
    return canonical_hash(fields)


def differing_fields(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted names of every leaf that differs between two fingerprint field sets (e.g. `config.ridge`)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                out.append(name)
            elif old[key] != new[key]:
                out.extend(differing_fields(old[key], new[key], name))
        return out
    return [] if old == new else [path or "(value)"]


def describe_differences(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 8) -> str:
    """One line naming the fields that differ, with old → new values for config fields."""
    names = differing_fields(old, new)
    parts = []
    for name in names[:limit]:
        if name.startswith("config.") and name.count(".") == 1:
            key = name.split(".", 1)[1]
            parts.append(f"{key} {json.dumps(old.get('config', {}).get(key))} → {json.dumps(new.get('config', {}).get(key))}")
        else:
            parts.append(name)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(parts) + more
