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
    """A generation request is invalid (empty prompt, too long, bad sampling values); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(S2DError):
    """The server is at its configured limit (maps to HTTP 429)."""


class ModelNotFoundError(RequestError):
    """The request names a model this app does not serve (HTTP 404)."""


class RequestTimeoutError(RequestError):
    """The request ran past limits.request_timeout_s and was aborted (HTTP 504)."""


class ServiceUnavailableError(S2DError):
    """A target deployment (or its TP group) failed or timed out: HTTP 503, retry later."""
