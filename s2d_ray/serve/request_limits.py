"""Per-request work bounds, checked on a parsed request's fields before it reaches the queue, the tokenizer or the
grammar compiler.

A body within `max_body_bytes` can still ask for work out of proportion to its size: 10^5 bad words each encoded and
matched every round, a 1 MiB JSON schema compiled into a grammar, thousands of stop ids or biases applied per row.
Each bound is a `Limits` field; exceeding one is a 400 naming the request field. Only counts and lengths are read
here (no tokenizing, no compiling), so the check is cheap enough for the event loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..errors import RequestError
from .app_config import Limits


def check_request_limits(req: Any, limits: Limits) -> None:
    """Raise RequestError (param: the field) when `req` (an OpenAI request or a GenerateRequest) exceeds a bound."""
    stops = list(req.stop_list)
    _count("stop", len(stops), limits.max_stop_strings)
    _longest("stop", stops, limits.max_stop_chars)
    _count("stop_token_ids", len(req.stop_token_ids or ()), limits.max_stop_token_ids)
    words = list(req.bad_words or ())
    _count("bad_words", len(words), limits.max_bad_words)
    _longest("bad_words", words, limits.max_bad_word_chars)
    _count("logit_bias", len(req.logit_bias or {}), limits.max_logit_bias)
    tools = getattr(req, "tools", None) or []
    _count("tools", len(tools), limits.max_tools)
    for field in ("tools", "response_format", "structured_outputs"):
        value = getattr(req, field, None)
        if value:
            size = _json_size(value)
            if size > limits.max_schema_bytes:
                raise RequestError(f"{field} is {size} bytes of JSON; the limit is {limits.max_schema_bytes} "
                                   "(limits.max_schema_bytes)", field)


def _count(field: str, n: int, limit: int) -> None:
    if n > limit:
        raise RequestError(f"{field} has {n} entries; the limit is {limit}", field)


def _longest(field: str, items: list[str], limit: int) -> None:
    longest = max((len(s) for s in items), default=0)
    if longest > limit:
        raise RequestError(f"{field} has an entry of {longest} characters; the limit is {limit}", field)


def _json_size(value: BaseModel | list[BaseModel]) -> int:
    """Size of the value's JSON (pydantic's serializer: no Python walk of a large schema)."""
    items = value if isinstance(value, list) else [value]
    return sum(len(v.model_dump_json(by_alias=True, exclude_none=True)) for v in items)


LIGHT_TEXT_CHARS = 4096  # a prompt or conversation up to this long is templated and tokenized in about a millisecond


def heavy_request(req: Any) -> bool:
    """Whether preparing `req` may take long (a grammar compile, tool schemas, bad words to encode, a long text):
    such requests are prepared at a bounded share of a core (serve/admission.py), the others at once."""
    if getattr(req, "tools", None) or req.structured_outputs is not None or req.bad_words:
        return True
    if req.response_format is not None and req.response_format.type != "text":
        return True
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids) > LIGHT_TEXT_CHARS
    text = len(req.prompt or "") + sum(len(m.text()) for m in req.messages or ())
    return text > LIGHT_TEXT_CHARS
