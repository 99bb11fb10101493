"""Request shapes: the OpenAI-compatible HTTP API's requests and the Python handle API's request and responses.

Requests are validated strictly (a string where a number belongs is a 400, not silently coerced); nothing is silently
ignored: fields without effect here are listed (request_fields.IGNORED), fields OpenAI or vLLM define that this server
does not implement are refused by name (request_fields.UNSUPPORTED), unknown fields too.
One OpenAI request fans out into one GenerateRequest per choice: per prompt of a batch, `n` samples (choice index
prompt_index * n + i); sample i uses seed + i when a seed is given (as vLLM), so every choice is reproducible.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.logprobs import TokenLogprob
from ..errors import RequestError
from ..structured.tools import wire_calls
from .request_fields import (
    ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolChoice, effective_tool_choice, refuse_unsupported,
)

TOKEN_KEY = re.compile(r"-?[0-9]{1,12}")  # a logit_bias key: a token id as a decimal string
OPENAI_TEMPERATURE = 1.0  # OpenAI's default: the HTTP API behaves as OpenAI clients expect
HANDLE_TEMPERATURE = 0.0  # the handle API's default: greedy, the deterministic output programs compare

Temperature = Annotated[float, Field(ge=0.0, le=2.0, description="Sampling temperature; 0 (and anything below "
                                     "core.types.GREEDY_TEMPERATURE) decodes greedily.")]


class SamplingFields(BaseModel):
    """How one completion is sampled and bounded: the fields both entry points share, declared once. The OpenAI
    requests (`OpenAIFields`) and the handle API's `GenerateRequest` extend it; each OpenAI choice becomes a
    GenerateRequest with these fields copied (`sampling`)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=0, description="Completion length limit (0: nothing generated, e.g. "
                                   "echo or prompt logprobs only); default: the server's.")
    temperature: Temperature = OPENAI_TEMPERATURE
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables (not in OpenAI's API).")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(None, description="Strings that end the completion (not returned).")
    speculate: bool = Field(True, description="false: plain target decoding for this request, no draft or lookup "
                            "(not in OpenAI's API; the output is the same, only its speed differs).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract count x this from the logit of "
                                     "each token generated so far (OpenAI's formula).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract this from the logit of each token "
                                    "generated so far (OpenAI's formula).")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's: over prompt + output tokens, a "
                                      "positive logit is divided by it, a negative one multiplied.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100] "
                                                "added to its logit.")
    min_tokens: int = Field(0, ge=0, description="Stop tokens are banned until this many tokens were generated "
                            "(vLLM's).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the completion, besides EOS "
                                             "(vLLM's).")
    ignore_eos: bool = Field(False, description="Do not stop at EOS (vLLM's); stop_token_ids still stop.")
    bad_words: list[str] | None = Field(None, description="Strings never generated (vLLM's): each one's token "
                                        "sequence is banned, with and without a leading space.")
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, json_object, or json_schema "
                                                   "(the output always validates: decoding is constrained).")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's extension: the output matches "
                                                         "one of json (a schema), regex, choice or grammar (Lark).")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, value):
        """The handle API may give integer keys; JSON always has strings."""
        return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not TOKEN_KEY.fullmatch(key):
                raise ValueError(f"keys are token ids as strings; got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} is {bias}; biases are in [-100, 100]")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self) -> dict[str, Any]:
        """The shared fields as keyword arguments of a GenerateRequest (stop as a list)."""
        return {**{name: getattr(self, name) for name in SamplingFields.model_fields}, "stop": self.stop_list}


STRICT = ConfigDict(extra="forbid", strict=True)  # OpenAI shapes: strict types, unknown fields refused by name


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; an assistant's earlier tool calls and the tools' answers (role tool) render as text in the
    format the model was shown (structured/tools.py)."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        return self

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return body + wire_calls([(c.function.name, c.function.arguments) for c in self.tool_calls or []])

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class OpenAIFields(SamplingFields):
    """What both OpenAI requests add to the sampling fields: choices, streaming, OpenAI's limits. Validated strictly
    (a string where a number belongs is a 400); an unknown field is a 400 naming it (docs/OPENAI.md)."""

    model_config = STRICT

    n: int = Field(1, ge=1, description="Independent samples per prompt (bounded by limits.max_choices).")
    stream: bool = Field(False, description="Server-sent events, one chunk per round.")
    user: str | None = Field(None, description="Accepted without effect on the output (request_fields.IGNORED); "
                             "with `suffix.scope: api_key` it narrows the tenant's store of earlier outputs to this "
                             "end user (docs/CACHING.md).")
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="As vLLM's: requests share "
                                   "cached prefixes (and earlier outputs) only with requests of the same tenant and "
                                   "the same salt. No effect on the output.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted without effect.")
    store: bool | None = Field(None, description="Accepted without effect: nothing is stored.")
    service_tier: str | None = Field(None, description="Accepted without effect: one tier.")
    prompt_cache_key: str | None = Field(None, description="Accepted without effect.")
    safety_identifier: str | None = Field(None, description="Accepted without effect on the output; keys the "
                                          "store of earlier outputs as `user` does.")
    stream_options: dict[str, Any] | None = Field(None, description="Accepted: usage is always on the last chunk.")
    request_id: str | None = Field(None, description="Accepted without effect (responses carry their own id).")
    return_token_ids: bool = Field(False, description="Each choice (each stream chunk) also carries the ids of "
                                   "the tokens it generated, `token_ids` (as vLLM's): exact comparisons need no "
                                   "re-encoding of text.")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data)

    @model_validator(mode="after")
    def _stops(self) -> "OpenAIFields":
        # Their count and length are bounded by limits.max_stop_strings / max_stop_chars (request_limits.py).
        if any(not s for s in self.stop_list):
            raise ValueError("stop strings must be non-empty")
        return self

    def fan_out(self, prompts: list[dict[str, Any]], fields: dict[str, Any],
                max_choices: int | None) -> list["GenerateRequest"]:
        """One GenerateRequest per choice, in choice order; sample i of a prompt uses seed + i. The choice count is
        checked BEFORE anything is built: n is a client's number and may be huge."""
        if max_choices is not None and len(prompts) * self.n > max_choices:
            raise RequestError(f"{len(prompts) * self.n} choices requested (prompts x n); the limit is {max_choices}",
                               "n")
        out = []
        for prompt in prompts:
            for i in range(self.n):
                seed = None if self.seed is None else self.seed + i
                out.append(GenerateRequest(model=self.model, **prompt, **{**fields, "seed": seed}))
        return out


class CompletionRequest(OpenAIFields):
    model: str = Field(description="Target name (see /v1/models).")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, token ids, or a batch of either (one choice per prompt, index in order).")
    logprobs: int | None = Field(None, ge=0, description="Logprob of each token plus the top-n alternatives.")
    echo: bool = Field(False, description="Return the prompt (and, with logprobs, its tokens' logprobs) too.")
    best_of: int | None = Field(None, ge=1, description="Only best_of == n (or unset) is supported.")

    @model_validator(mode="after")
    def _supported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n); sample n choices and rank them yourself")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 is allowed only with echo)")
        return self

    def to_generate(self, max_choices: int | None = None) -> list["GenerateRequest"]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            prompt = [prompt]
        if not prompt:
            raise RequestError("prompt is empty")
        prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]
        prompt_logprobs = self.echo and self.logprobs is not None
        fields = {**self.sampling(), "logprobs": self.logprobs, "prompt_logprobs": prompt_logprobs}
        return self.fan_out(prompts, fields, max_choices)


class ChatCompletionRequest(OpenAIFields):
    model: str = Field(description="Target name (see /v1/models).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation; the chat template renders it.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer OpenAI clients).")
    logprobs: bool | None = Field(None, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(None, ge=0, description="Also the top-n alternatives (needs logprobs: true).")
    tools: list[Tool] | None = Field(None, description="Functions the model may call (constrained decoding).")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (default with tools), required, or "
                                           "{type: function, function: {name}}.")
    parallel_tool_calls: bool | None = Field(None, description="true (the default, as OpenAI's): a response may "
                                             "make several tool calls; false: at most one.")

    @field_validator("max_tokens")
    @classmethod
    def _generates(cls, value: int | None) -> int | None:
        if value == 0:  # no echo in chat: 0 would return nothing
            raise ValueError("max_tokens must be >= 1")
        return value

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def to_generate(self, max_choices: int | None = None) -> list["GenerateRequest"]:
        fields = self.sampling()
        fields["max_tokens"] = self.max_tokens or self.max_completion_tokens
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        fields["tools"], fields["tool_choice"] = self.tools, self.tool_choice
        fields["parallel_tool_calls"] = self.parallel_tool_calls is not False
        return self.fan_out([{"messages": self.messages}], fields, max_choices)


class GenerateRequest(SamplingFields):
    """The Python handle API's request: `await handle.generate.remote(GenerateRequest(...))`. The sampling fields
    are the HTTP API's with one override: temperature defaults to HANDLE_TEMPERATURE (greedy)."""

    temperature: Temperature = HANDLE_TEMPERATURE
    model: str = Field(description="Target name.")
    prompt: str | None = Field(None, description="Plain text prompt (no chat template).")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages (the target's chat template).")
    prompt_token_ids: list[int] | None = Field(None, description="Token ids, used as they are.")
    logprobs: int | None = Field(None, ge=0, description="Target logprob of each generated token plus the top-n "
                                 "alternatives (0: none); off when unset.")
    prompt_logprobs: bool = Field(False, description="Also the prompt tokens' logprobs (first token: None).")
    tools: list[Tool] | None = Field(None, description="Functions the model may call (with messages).")
    tool_choice: ToolChoice | None = Field(None, description="As OpenAI's chat tool_choice.")
    parallel_tool_calls: bool = Field(True, description="As OpenAI's: several calls in one response (one per line "
                                      "of the output), or at most one.")
    suffix_scope: str | None = Field(None, description="Whose earlier outputs, within the tenant, this request drafts "
                                     "from and adds to under `suffix.scope: api_key` (docs/CACHING.md); the HTTP API "
                                     "derives it from `user` / `safety_identifier`. The output is the same whatever "
                                     "it is.")
    tenant: str | None = Field(None, max_length=64, description="The tenant the request runs as: its prefix cache and "
                               "store of earlier outputs (tenants.isolation). The HTTP API sets it from the bearer "
                               "key; handle callers are trusted code and name it.")
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="As the HTTP field.")

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        given = [x for x in (self.prompt, self.messages, self.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        if self.tools and self.messages is None:
            raise ValueError("tools need messages (the chat template)")
        return self

    @property
    def tool_mode(self) -> str | None:
        """"auto", "required" or a function's name while tools constrain the output, else None."""
        return effective_tool_choice(self.tools, self.tool_choice)


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
    logprobs: list[TokenLogprob] | None = Field(None, description="Per generated token, when asked.")
    prompt_token_ids: list[int] | None = Field(None, description="The encoded prompt, with prompt_logprobs.")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(None, description="Per prompt token, when asked.")


class GenerateChunk(BaseModel):
    """One streamed piece: the text and tokens a round added; the last one has finish_reason, usage and metrics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only, with prompt_logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first chunk only
