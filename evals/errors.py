"""Exceptions raised by the evaluation suite (subclasses of the core's ConfigError, so callers catch one family)."""

from __future__ import annotations

from pathlib import Path

from translators.errors import ConfigError


class DataNotFoundError(ConfigError):
    """A benchmark data file is missing. The message names the path looked at and where to get the file."""


def require_file(path: str | Path, what: str, how_to_get: str) -> Path:
    """Return `path` as a Path if it is an existing file.

    Raises:
        DataNotFoundError: the file does not exist; the message says where it looked and how to get it.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataNotFoundError(f"{what} not found at {path.resolve()}. {how_to_get}")
    return path
