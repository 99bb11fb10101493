"""The OpenAI-compatible API's shapes in one place, as the rest of the package and handle callers import them
(`from s2d_ray.serve.openai_protocol import GenerateRequest`): requests in request_shapes.py, response rendering in
response_render.py, a chat choice's tool calls in tool_deltas.py."""

from .request_shapes import (
    HANDLE_TEMPERATURE, OPENAI_TEMPERATURE, STRICT, TOKEN_KEY, ChatCompletionRequest, ChatMessage, CompletionRequest,
    GenerateChunk, GenerateRequest, GenerateResponse, OpenAIFields, SamplingFields, Temperature, TextPart, Usage,
)
from .response_render import (
    MIN_LOGPROB, ChoiceView, ResponseIds, error_body, full_response, stream_chunk, total_usage, usage_chunk,
)
from .tool_deltas import ToolCallDeltas

__all__ = [
    "HANDLE_TEMPERATURE", "MIN_LOGPROB", "OPENAI_TEMPERATURE", "STRICT", "TOKEN_KEY", "ChatCompletionRequest",
    "ChatMessage", "ChoiceView", "CompletionRequest", "GenerateChunk", "GenerateRequest", "GenerateResponse",
    "OpenAIFields", "ResponseIds", "SamplingFields", "Temperature", "TextPart", "ToolCallDeltas", "Usage",
    "error_body", "full_response", "stream_chunk", "total_usage", "usage_chunk",
]
