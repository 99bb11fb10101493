"""Request and response shapes: the OpenAI-compatible HTTP API and the pydantic request of the Python handle API.

Requests are validated strictly (a string where a number belongs is a 400, not silently coerced); unknown fields
that OpenAI clients commonly send are ignored, unsupported values of known ones (n > 1, logprobs) are refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import RequestError

MAX_STOP_STRINGS = 4


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class SamplingFields(_Lenient):
    max_tokens: int | None = Field(None, ge=1, description="Completion length limit; default: the server's.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables (extension).")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the completion.")
    n: int = Field(1, ge=1, le=1, description="Only 1 choice per request is supported.")
    stream: bool = Field(False, description="Server-sent events, one chunk per round.")
    user: str | None = Field(None, description="Ignored (OpenAI compatibility).")

    @model_validator(mode="after")
    def _stops(self) -> "SamplingFields":
        stops = self.stop_list
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return self

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": self.stop_list}

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class CompletionRequest(SamplingFields):
    model: str = Field(description="Target name (see /v1/models).")
    prompt: str | list[str] | list[int] = Field(description="Text, a one-element list of text, or token ids.")
    logprobs: None = Field(None, description="Not supported.")
    echo: Literal[False] = Field(False, description="Not supported.")

    def to_generate(self) -> "GenerateRequest":
        prompt, ids = self.prompt, None
        if isinstance(prompt, list):
            if prompt and all(isinstance(p, int) for p in prompt):
                prompt, ids = None, list(prompt)
            elif len(prompt) == 1:
                prompt = prompt[0]
            else:
                raise RequestError("send exactly one prompt per request")
        return GenerateRequest(model=self.model, prompt=prompt, prompt_token_ids=ids, **self.sampling())


class ChatCompletionRequest(SamplingFields):
    model: str = Field(description="Target name (see /v1/models).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation; the chat template renders it.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer OpenAI clients).")
    logprobs: Literal[False] | None = Field(None, description="Not supported.")

    def to_generate(self) -> "GenerateRequest":
        fields = self.sampling()
        fields["max_tokens"] = self.max_tokens or self.max_completion_tokens
        return GenerateRequest(model=self.model, messages=self.messages, **fields)


class GenerateRequest(BaseModel):
    """The Python handle API's request: `await handle.generate.remote(GenerateRequest(...))`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Target name.")
    prompt: str | None = Field(None, description="Plain text prompt (no chat template).")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages (the target's chat template).")
    prompt_token_ids: list[int] | None = Field(None, description="Token ids, used as they are.")
    max_tokens: int | None = Field(None, ge=1, description="Completion length limit; default: the server's.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k; 0 disables.")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, description="Strings that end the completion.")

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        given = [x for x in (self.prompt, self.messages, self.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    metrics: dict[str, Any] = Field(description="The engine's per-request speculative decoding metrics.")


class GenerateChunk(BaseModel):
    """One streamed piece: the text and tokens a round added; the last one has finish_reason, usage and metrics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: dict[str, Any] | None = None


def error_body(message: str, code: str | None = None, param: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ResponseIds:
    """Ids and timestamps of one OpenAI response (shared by all its stream chunks)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, model: str, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": model}


def choice(ids: ResponseIds, text: str, finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
    if not ids.chat:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": None}


def full_response(ids: ResponseIds, resp: GenerateResponse) -> dict:
    return {**ids.head(resp.model, chunk=False), "choices": [choice(ids, resp.text, resp.finish_reason, False)],
            "usage": resp.usage.model_dump(), "metrics": {"speculative_decoding": resp.metrics}}


def stream_chunk(ids: ResponseIds, model: str, chunk: GenerateChunk, first: bool) -> dict:
    body = {**ids.head(model, chunk=True), "choices": [choice(ids, chunk.text, chunk.finish_reason, True, first)]}
    if chunk.usage is not None:
        body["usage"] = chunk.usage.model_dump()
        body["metrics"] = {"speculative_decoding": chunk.metrics}
    return body
