"""Exceptions of the tracking/registry layer. Each message says what to do next."""

from __future__ import annotations

from translators.errors import KvlingoError


class TrackingUnavailableError(KvlingoError):
    """The MLflow tracking store cannot be reached or written."""


class RegistryError(KvlingoError):
    """A registered model, version, alias or run does not exist or cannot be used as asked."""
