"""One small error hierarchy: every failure a user can cause maps to one of these, with a message that says the fix.

The errors the core raises live in core/errors.py (the core imports nothing from outside itself) and are re-exported
here, so `from s2d_ray.errors import X` names every class of the one hierarchy.
"""

from .core.errors import CapacityError, ModelLoadError, RequestError, S2DError

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "ModelLoadError", "ModelNotFoundError", "RequestError",
    "RequestTimeoutError", "S2DError", "ServiceUnavailableError", "TokenizerMismatchError",
]


class ConfigError(S2DError, ValueError):
    """A configuration value is invalid."""


class ChecksumError(ModelLoadError):
    """A downloaded or cached artifact does not match its recorded sha256."""


class TokenizerMismatchError(ModelLoadError):
    """Draft and target do not share a vocabulary, so draft tokens would mean different text."""


class ModelNotFoundError(RequestError):
    """The request names a model this app does not serve (HTTP 404)."""


class RequestTimeoutError(RequestError):
    """The request ran past limits.request_timeout_s and was aborted (HTTP 504)."""


class ServiceUnavailableError(S2DError):
    """A target deployment (or its TP group) failed or timed out: HTTP 503, retry later (`retry_after_s`, when
    known, becomes the response's Retry-After)."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
