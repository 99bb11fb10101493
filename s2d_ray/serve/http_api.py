"""The HTTP side of the ingress, apart from its routes: OpenAI-style errors, bounded body reads,
strict parsing of a request body, and the OpenAPI schema of routes that parse their own bodies."""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..errors import CapacityError, ModelNotFoundError, RequestError, RequestTimeoutError, ServiceUnavailableError
from .openai_protocol import error_body

Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds, rounded up)


def api_error(exc: Exception) -> ApiError:
    """Our exceptions -> HTTP status and OpenAI error body."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, str(exc), "model_not_found", "model")
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), "timeout", type_="timeout_error")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), "invalid_value", exc.param)
    if isinstance(exc, CapacityError):
        return ApiError(429, str(exc), "rate_limit_exceeded", type_="rate_limit_error")
    if isinstance(exc, ServiceUnavailableError):
        return server_error(exc, 503, "service unavailable", "service_unavailable", exc.retry_after_s)
    return server_error(exc, 500, "internal error", "internal_error")


def server_error(exc: Exception, status: int, what: str, code: str,
                 retry_after_s: float | None = None) -> ApiError:
    """A 5xx whose body carries an error id and nothing of the exception (its text can name hosts, processes and
    another request's state); the router's log has the exception under the same id. `retry_after_s`: a 503's
    Retry-After."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("%s (error id %s)", what, error_id, exc_info=exc)
    return ApiError(status, f"{what} (error id {error_id})", code, type_="server_error", retry_after_s=retry_after_s)


RETRY_AFTER_S = 1  # a 429's Retry-After: a round or two frees a place at the tiny-to-small sizes served here


def error_response(err: ApiError) -> JSONResponse:
    retry = err.retry_after_s if err.retry_after_s is not None else RETRY_AFTER_S if err.status == 429 else None
    headers = None if retry is None else {"retry-after": str(max(1, math.ceil(retry)))}
    return JSONResponse(error_body(err.message, err.code, err.param, err.type), status_code=err.status,
                        headers=headers)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    return ApiError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), "invalid_value", param)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", "body_too_large")
    body = bytearray()
    async for part in request.stream():
        body.extend(part)
        if len(body) > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", "body_too_large")
    return bytes(body)


def parse_body(raw: bytes, kind: type[Body]) -> Body:
    """A request body validated strictly as `kind`; 400 with the offending field otherwise."""
    try:
        json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than Python's stack
        raise ApiError(400, f"request body is not valid JSON ({exc})", "invalid_json") from None
    try:
        return kind.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _inline_refs(node, defs: dict):
    """Replace `{"$ref": "#/$defs/X"}` by X's schema (our request models are not recursive)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def body_schema(model: type[BaseModel]) -> dict:
    """OpenAPI body schema of a route that parses its own body (so size limits and errors stay ours)."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
