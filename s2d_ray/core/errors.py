"""The errors the core raises: the base of the package's one hierarchy (s2d_ray/errors.py adds the rest and
re-exports these), so the core stays free of imports from outside itself."""


class S2DError(Exception):
    """Base class: the CLI prints these as one line, the server maps them to 4xx."""


class ModelLoadError(S2DError):
    """A model source could not be resolved or loaded (missing files, checksum, architecture)."""


class RequestError(S2DError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling values); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(S2DError):
    """The server is at its configured limit (maps to HTTP 429)."""
