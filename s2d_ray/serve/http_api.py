"""The HTTP side of the ingress, apart from its routes: OpenAI-style errors, the bearer-key check, bounded body reads,
strict parsing of a request body, and the OpenAPI schema of routes that parse their own bodies."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..errors import CapacityError, ModelNotFoundError, RequestError, RequestTimeoutError, ServiceUnavailableError
from .openai_protocol import error_body

Body = TypeVar("Body", bound=BaseModel)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_


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
        return ApiError(503, str(exc), "service_unavailable", type_="server_error")
    return ApiError(500, "internal error", "internal_error", type_="server_error")


RETRY_AFTER_S = 1  # a 429's Retry-After: a round or two frees a place at the tiny-to-small sizes served here


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
    return JSONResponse(error_body(err.message, err.code, err.param, err.type), status_code=err.status,
                        headers=headers)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    return ApiError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), "invalid_value", param)


def authorize(request: Request, api_key: str | None) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <api_key>` (no key configured: open)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                       "invalid_api_key", type_="authentication_error")


def store_scope(request: Request, *identities: str | None) -> str:
    """A request's scope in the store of earlier outputs under `suffix.scope: api_key` (core/suffix.py): a digest of
    its bearer token and the client's end-user ids (`user`, `safety_identifier`), so no key is kept in the clear;
    "" for a request that gives none (all anonymous requests share one scope)."""
    _, _, token = request.headers.get("authorization", "").partition(" ")
    parts = [token.strip(), *(i or "" for i in identities)]
    if not any(parts):
        return ""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


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
