"""One small error hierarchy: every failure a user can cause maps to one of these, with a message that says the fix."""


class S2DError(Exception):
    """Base class: the CLI prints these as one line, the server maps them to 4xx."""


class ConfigError(S2DError, ValueError):
    """A configuration value is invalid."""


class ModelLoadError(S2DError):
    """A model source could not be resolved or loaded (missing files, checksum, architecture)."""


class ChecksumError(ModelLoadError):
    """A downloaded or cached artifact does not match its recorded sha256."""


class TokenizerMismatchError(ModelLoadError):
    """Draft and target do not share a vocabulary, so draft tokens would mean different text."""


class RequestError(S2DError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling values)."""


class CapacityError(S2DError):
    """The server is at its configured limit (maps to HTTP 429)."""
