"""Inter-process file locks: two kvlingo processes on one `KVLINGO_HOME` (two sweeps started at once, a sweep
beside a tracked fit) take turns on the work they share instead of doing it twice or interleaving writes.

Locks are `fcntl.flock` locks on files under `kvlingo_home()/locks`; the kernel releases them when the holder
exits, even when it is killed, so a crashed run never leaves a stale lock behind. They are not re-entrant:
a process that holds a lock and asks for it again waits for itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

from infra.settings import kvlingo_home

logger = logging.getLogger("kvlingo.locks")


def lock_path(name: str) -> Path:
    """The lock file of `name` under `kvlingo_home()/locks` (names that are not plain are hashed)."""
    plain = name.replace("-", "").replace("_", "").isalnum() and len(name) <= 128
    return kvlingo_home() / "locks" / f"{name if plain else hashlib.sha256(name.encode()).hexdigest()}.lock"


@contextlib.contextmanager
def file_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created with its directory) for the `with` block; when another
    process holds it, log that this one waits for `what`, then block until it is released.

    Raises:
        OSError: the lock file cannot be created (e.g. a read-only KVLINGO_HOME).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another kvlingo process: %s (lock %s)", what, path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def named_lock(name: str, what: str) -> contextlib.AbstractContextManager[None]:
    """:func:`file_lock` on :func:`lock_path` of `name`."""
    return file_lock(lock_path(name), what)
