"""The request fields that steer what is generated beyond sampling: penalties and biases, structured output
(`response_format`, the `structured_outputs` extension), tools; and the lists of fields accepted without effect and
fields refused by name (nothing a client sends is silently ignored: docs/OPENAI.md)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..errors import RequestError
from ..structured import GrammarSpec, ToolSpec, tool_grammar

STRICT = ConfigDict(extra="forbid", strict=True)

# Accepted and without effect on the output (docs/OPENAI.md says why each is safe).
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
           "request_id")

_INSTEAD = "use structured_outputs (docs/OPENAI.md)"
# Defined by OpenAI or vLLM, not implemented here: a 400 naming the field (and what to do instead, where any).
UNSUPPORTED = {
    **{f: f"{f} is not supported; {_INSTEAD}" for f in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "structural_tag")},
    "functions": "functions is deprecated by OpenAI and not supported; use tools",
    "function_call": "function_call is deprecated by OpenAI and not supported; use tool_choice",
    **{f: f"{f} is not supported by this server" for f in (
        "audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options", "suffix",
        "min_p", "length_penalty", "include_stop_str_in_output", "allowed_token_ids", "truncate_prompt_tokens",
        "prompt_logprobs", "use_beam_search", "logits_processors", "chat_template", "chat_template_kwargs",
        "add_generation_prompt", "continue_final_message", "documents", "priority", "skip_special_tokens",
        "spaces_between_special_tokens", "return_tokens_as_token_ids", "add_special_tokens", "mm_processor_kwargs",
        "kv_transfer_params", "vllm_xargs", "top_a", "typical_p")},
}


def refuse_unsupported(data: Any) -> Any:
    """A before-validator: a field from UNSUPPORTED is a ValueError at that field (a 400 naming it)."""
    if isinstance(data, dict):
        for name, why in UNSUPPORTED.items():
            if name in data:
                error = PydanticCustomError("unsupported", why)
                raise ValidationError.from_exception_data(
                    "request", [InitErrorDetails(type=error, loc=(name,), input=data[name])])
    return data


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field("response", description="The schema's name (OpenAI requires one; unused here).")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output must validate against.")
    strict: bool | None = Field(None, description="Always strict here: the output is decoded within the schema.")
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema (and only then)")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of json (a schema), regex, choice, grammar (Lark)."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (object or string).")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, min_length=1, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="A grammar in llguidance's Lark syntax.")

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        if sum(x is not None for x in (self.json_, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self

    def spec(self) -> GrammarSpec:
        p = "structured_outputs"
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise RequestError(f"{p}.json is not valid JSON ({exc})", p) from None
            return GrammarSpec.json_schema(schema, p)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, p)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice), p)
        return GrammarSpec("grammar", self.grammar or "", p)


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments (default: none).")
    strict: bool | None = Field(None, description="Always strict here: arguments are decoded within the schema.")


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message a client sends back (the conversation so far)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


def grammar_of(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
               tools: list[Tool] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool = True) -> GrammarSpec | None:
    """The one constraint a request asks for (at most one of the three kinds), or None; tool calls are one or more
    with `parallel_tool_calls`, else exactly one."""
    choice = effective_tool_choice(tools, tool_choice)
    asked = [n for n, v in (("response_format", response_format if response_format and response_format.type != "text"
                                               else None),
                            ("structured_outputs", structured), ("tools", choice)) if v is not None]
    if len(asked) > 1:
        raise RequestError(f"{' and '.join(asked)} each constrain the output; give one", asked[-1])
    if structured is not None:
        return structured.spec()
    if choice is not None:
        return tool_grammar(tool_specs(tools or []), choice, parallel_tool_calls)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    return GrammarSpec.json_schema(response_format.json_schema.schema_, "response_format")


def tool_specs(tools: list[Tool]) -> tuple[ToolSpec, ...]:
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools: function names must be unique", "tools")
    return tuple(ToolSpec.of(t.function.name, t.function.parameters, t.function.description) for t in tools)


def effective_tool_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> str | None:
    """"auto", "required" or a function name when the output is constrained to tools; None when not (no tools, or
    tool_choice none). OpenAI's default is auto when tools are given."""
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if not tools or name not in [t.function.name for t in tools]:
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return name
    if not tools:
        if tool_choice in ("auto", "required"):
            raise RequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return None
    return None if tool_choice == "none" else (tool_choice or "auto")
