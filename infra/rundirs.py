"""Where runs live: one helper for every command that writes or looks for a fit.

Layout: `$KVLINGO_HOME/runs/<source>--<target>/<fingerprint[:16]>/` holding config.yaml, fingerprint.json,
data_manifest.json, summary.json, closed_form/, distilled/, checkpoints/ and sweep/. A fit with another
config, other data or other model weights gets another directory, so nothing is resumed or overwritten by a
run it does not belong to.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from infra.settings import kvlingo_home
from translators.errors import ConfigError

FINGERPRINT_CHARS = 16


def model_slug(name: str) -> str:
    """A file-name-safe name: zoo names as they are, hub ids with '/' → '_', local directories as their base
    name plus a hash of the absolute path (two folders called `model` stay apart)."""
    path = Path(name).expanduser()
    if path.is_dir() or path.is_absolute() or name.startswith((".", "~")):  # as infra.zoo.resolve_model reads it
        resolved = path.resolve()
        return f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"
    return name.replace("/", "_")


def pair_runs_dir(source: str, target: str) -> Path:
    """`$KVLINGO_HOME/runs/<source>--<target>`: every fit of this direction lives below it."""
    return kvlingo_home() / "runs" / f"{model_slug(source)}--{model_slug(target)}"


def run_dir(source: str, target: str, fingerprint: str) -> Path:
    """The default output directory of the fit with this fingerprint."""
    return pair_runs_dir(source, target) / fingerprint[:FINGERPRINT_CHARS]


def latest_fit_dir(source: str, target: str) -> Path:
    """The most recently finished fit of this direction (newest summary.json).

    Raises:
        ConfigError: no finished fit exists for the pair, naming the fit command to run.
    """
    root = pair_runs_dir(source, target)
    found = sorted(root.glob("*/summary.json"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not found:
        raise ConfigError(f"no finished fit of {source} → {target} under {root}: run `kvlingo fit {source} {target}` "
                          "first, or pass the fit's directory explicitly")
    return found[-1].parent
