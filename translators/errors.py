"""Exceptions raised by the numerical core. Each carries a message that says what to do next."""


class KvlingoError(Exception):
    """Base class of every user-facing kvlingo error."""


class ConfigError(KvlingoError):
    """A configuration or argument value is invalid."""


class UnsupportedModelError(KvlingoError):
    """The model's architecture lacks something capture/injection needs."""


class PrefixTooLongError(KvlingoError):
    """A prompt or prefix exceeds a model's maximum positions."""


class NonFiniteError(KvlingoError):
    """A capture or a loss contained NaN or Inf."""


class PairMismatchError(KvlingoError):
    """An artifact, checkpoint or statistic belongs to another model pair or configuration."""
