"""What the stage-1 statistics store holds, and pruning it.

The store (`$KVLINGO_HOME/stats/<key>/`, written by `tasks.fit.store_shard`) keeps one directory per shard of
finished Gram statistics, addressed by content, and nothing evicts an entry by itself: a SmolLM2 → Gemma-3 shard
is about 0.75 GB, and one machine's store reached 61 GB. An entry's last use is its directory's mtime, which
`mark_used` sets whenever a fit reads it back (the filesystem's atime is not reliable under relatime or noatime).
Pruning removes whole entries only, so a later fit finds a shard complete or recomputes it.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from infra.settings import kvlingo_home
from translators.errors import ConfigError

# A temporary shard directory (`<key>.<pid>-<thread>.tmp`) is written in minutes; one untouched for a day was
# left by a killed process. Age, not the writer's pid, decides: the store may be shared by several machines.
STALE_TMP_S = 24 * 3600


@dataclass(frozen=True)
class StoreEntry:
    """One directory of the store: a finished shard, or a temporary one (`tmp`)."""

    path: Path
    bytes: int
    last_used: float  # seconds since the epoch
    tmp: bool


def store_root() -> Path:
    """The statistics store's directory (it may not exist yet)."""
    return kvlingo_home() / "stats"


def mark_used(entry: Path) -> None:
    """Record that a fit read `entry` now (its directory's mtime), so pruning by last use keeps it longest."""
    os.utime(entry)


def store_entries(root: Path) -> list[StoreEntry]:
    """Every directory under `root`, least recently used first ([] when `root` does not exist)."""
    if not root.is_dir():
        return []
    entries = []
    for path in root.iterdir():
        if not path.is_dir():
            continue
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        entries.append(StoreEntry(path, size, path.stat().st_mtime, path.name.endswith(".tmp")))
    return sorted(entries, key=lambda e: (e.last_used, e.path.name))


def entries_to_prune(entries: list[StoreEntry], *, max_bytes: int | None, unused_s: float | None,
                     now: float) -> list[StoreEntry]:
    """Which entries to remove: temporary directories older than a day; finished ones unused for more than
    `unused_s`; then the least recently used until the rest total at most `max_bytes`."""
    stale = [e for e in entries if e.tmp and now - e.last_used > STALE_TMP_S]
    finished = [e for e in entries if not e.tmp]
    doomed = [e for e in finished if unused_s is not None and now - e.last_used > unused_s]
    if max_bytes is not None:
        kept = [e for e in finished if e not in doomed]
        total = sum(e.bytes for e in kept)
        for entry in kept:  # least recently used first
            if total <= max_bytes:
                break
            doomed.append(entry)
            total -= entry.bytes
    return stale + doomed


def check_prune_options(max_gb: float | None, unused_days: float | None) -> list[str]:
    """Every problem with the prune options, for the caller to report at once ([] when they are valid)."""
    problems = []
    if max_gb is None and unused_days is None:
        problems.append("say what to keep: --max-gb G (keep the most recently used G GB) and/or --unused-days D "
                        "(remove entries no fit has read for D days)")
    if max_gb is not None and max_gb < 0:
        problems.append(f"--max-gb must be ≥ 0, got {max_gb}")
    if unused_days is not None and unused_days < 0:
        problems.append(f"--unused-days must be ≥ 0, got {unused_days}")
    return problems


def prune_store(root: Path, *, max_gb: float | None = None, unused_days: float | None = None,
                dry_run: bool = False, now: float | None = None) -> dict:
    """Remove entries of the store at `root` (see `entries_to_prune`); with `dry_run`, only say which.

    Returns {"root", "removed": [names], "freed_bytes", "kept", "kept_bytes", "dry_run"}.

    Raises:
        ConfigError: neither option given, or a negative one (every problem in one message).
    """
    problems = check_prune_options(max_gb, unused_days)
    if problems:
        raise ConfigError("; ".join(problems))
    entries = store_entries(root)
    doomed = entries_to_prune(entries, max_bytes=None if max_gb is None else int(max_gb * 1e9),
                              unused_s=None if unused_days is None else unused_days * 86400,
                              now=time.time() if now is None else now)
    if not dry_run:
        for entry in doomed:
            shutil.rmtree(entry.path, ignore_errors=True)  # a concurrent prune may have removed it already
    removed = {e.path for e in doomed}
    kept = [e for e in entries if e.path not in removed]
    return {"root": str(root), "removed": sorted(e.path.name for e in doomed),
            "freed_bytes": sum(e.bytes for e in doomed), "kept": len(kept),
            "kept_bytes": sum(e.bytes for e in kept), "dry_run": dry_run}


def store_usage(root: Path) -> dict:
    """{"root", "entries", "bytes", "tmp_entries", "oldest_use", "newest_use"} (uses as epoch seconds, or None)."""
    entries = store_entries(root)
    finished = [e for e in entries if not e.tmp]
    return {"root": str(root), "entries": len(finished), "bytes": sum(e.bytes for e in entries),
            "tmp_entries": len(entries) - len(finished),
            "oldest_use": finished[0].last_used if finished else None,
            "newest_use": finished[-1].last_used if finished else None}


def disk_full_message(err: OSError) -> str:
    """What to do when a fit ran out of disk: how much the store holds and how to free it (a re-run resumes)."""
    usage = store_usage(store_root())
    return (f"no space left on the device writing {err.filename or 'a file'}. The stage-1 statistics store "
            f"{usage['root']} holds {usage['bytes'] / 1e9:.1f} GB in {usage['entries']} shard(s): "
            "`kvlingo stats-store prune --max-gb G` keeps the most recently read G GB. Re-running the same command "
            "then resumes from the finished statistics shards and the last stage-2 checkpoint.")
