"""From a validated request to an engine GenerationRequest (limits checked), and from tokens back to text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ..core.engine import GenerationRequest
from ..core.stop_strings import stop_string_at
from ..core.types import GREEDY_TEMPERATURE, SamplingParams
from ..errors import RequestError
from ..prompts import encode_prompt
from ..structured.requests import PenaltySpec, bad_word_ids, bias_pairs, check_ids, request_processors, stop_ids
from .app_config import Limits
from .chat_render import encode_chat
from .detokenize import IncrementalText, cleans_up_spaces
from .openai_protocol import GenerateRequest
from .request_fields import grammar_of, tool_specs


@dataclass
class ModelInfo:
    """What the router knows about a target: text <-> ids, its context, its end-of-sequence ids."""

    name: str
    tokenizer: object
    max_context: int
    eos_ids: tuple[int, ...]

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def encode(info: ModelInfo, req: GenerateRequest) -> list[int]:
    """Prompt token ids: text as is, messages through the chat template, ids checked against the vocabulary."""
    tok = info.tokenizer
    if req.prompt_token_ids is not None:
        if not req.prompt_token_ids:
            raise RequestError("prompt is empty")
        check_ids(req.prompt_token_ids, len(tok), "prompt")
        return list(req.prompt_token_ids)
    if req.messages is not None:
        if not any(m.text().strip() for m in req.messages):
            raise RequestError("messages are empty")
        mode = req.tool_mode  # the tools are shown when set (the grammar enforces the call's format)
        return encode_chat(tok, req.messages, tool_specs(req.tools) if mode is not None else None, mode,
                           req.parallel_tool_calls)
    return encode_prompt(tok, req.prompt or "", chat=False)


def to_generation(info: ModelInfo, req: GenerateRequest, limits: Limits) -> GenerationRequest:
    """Check lengths against the context and the configured limits; a fresh uuid4 seq id per request."""
    ids = encode(info, req)
    window = min(info.max_context, limits.max_total_tokens)
    if len(ids) > limits.max_prompt_tokens:
        raise RequestError(f"prompt has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
    if len(ids) >= window:
        raise RequestError(f"prompt has {len(ids)} tokens; {req.model} accepts at most {window - 1} "
                           "(context length minus one generated token)")
    if req.max_tokens is not None and req.max_tokens > limits.max_tokens_limit:
        raise RequestError(f"max_tokens is {req.max_tokens}; the limit is {limits.max_tokens_limit}")
    check_logprobs(req, len(ids), limits)
    # max_tokens 0 (echo, scoring): decode one token and drop it (the router does), so the engine stays one loop.
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens or min(limits.default_max_tokens, window - len(ids))
    if len(ids) + max_tokens > window:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {req.model}'s "
                           f"limit of {window} tokens; lower max_tokens")
    # Below GREEDY_TEMPERATURE, logits / temperature overflows to inf (NaN probabilities would fail the whole round
    # of every sequence on the target); the limit t -> 0 is greedy, so decode greedily (as vLLM does).
    temperature = req.temperature if req.temperature >= GREEDY_TEMPERATURE else 0.0
    params = SamplingParams(temperature=temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed)
    if req.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    stops = stop_ids(info.eos_ids, req.stop_token_ids, req.ignore_eos, len(info.tokenizer))
    processors = build_processors(info, req, len(ids), stops)
    extra = {"processors": processors} if processors else {}
    return GenerationRequest(uuid.uuid4().hex, ids, max_tokens, params, stops, tuple(req.stop_list),
                             min_tokens=req.min_tokens, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, speculate=req.speculate,
                             **extra)


def build_processors(info: ModelInfo, req: GenerateRequest, prompt_len: int, stops: tuple[int, ...]) -> tuple:
    """Penalties, biases, bans and the grammar of one request (empty when it asks for none), its fields checked."""
    vocab = len(info.tokenizer)
    penalties = PenaltySpec(
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=bias_pairs(req.logit_bias, vocab),
        min_tokens=req.min_tokens, bad_words=bad_word_ids(info.tokenizer, req.bad_words))
    grammar = grammar_of(req.response_format, req.structured_outputs, req.tools, req.tool_choice,
                         req.parallel_tool_calls)
    return request_processors(info.tokenizer, prompt_len, stops, penalties, grammar)


def check_logprobs(req: GenerateRequest, n_prompt: int, limits: Limits) -> None:
    if req.logprobs is not None and req.logprobs > limits.max_logprobs:
        raise RequestError(f"logprobs / top_logprobs is {req.logprobs}; the limit is {limits.max_logprobs}")
    bound = limits.max_prompt_logprobs_tokens
    if req.prompt_logprobs and bound is not None and n_prompt > bound:
        raise RequestError(f"prompt has {n_prompt} tokens; with echo / prompt logprobs the limit is "
                           f"{limits.max_prompt_logprobs_tokens}")


class TextAssembler:
    """Streaming text: never emits half a UTF-8 character or the start of a stop string, and the concatenated
    deltas always equal the final text (the non-streaming response). Each round decodes only its new tokens
    (detokenize.IncrementalText); the final text is one whole decode. A stop string counts only where it ends after
    the first `min_tokens` tokens' text (the engine's rule)."""

    def __init__(self, info: ModelInfo, stop: tuple[str, ...], ids: list[int] | None = None,
                 min_tokens: int = 0) -> None:
        self.info, self.stop, self.min_tokens = info, stop, min_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.stream = IncrementalText(info.detokenize, whole=cleans_up_spaces(info.tokenizer))
        if ids:
            self.stream.extend(list(ids))
        self.sent = 0  # characters of stream.text sent so far

    @property
    def ids(self) -> list[int]:
        return self.stream.ids

    def push(self, tokens: list[int]) -> str:
        self.stream.extend(tokens)
        safe = len(self.stream.text) - self.holdback
        if safe <= self.sent:
            return ""
        delta = self.stream.text[self.sent:safe]
        self.sent = safe
        return delta

    def finish(self, tokens: list[int] = ()) -> str:
        """The last tokens' text and the rest held back, cut before the first stop string (OpenAI does not return
        the stop string; the last tokens are where the engine found it, so they are not pushed as a round's)."""
        self.stream.ids.extend(tokens)
        text, sent = self.final_text(), self.stream.text[:self.sent]
        delta = text[len(sent):] if text.startswith(sent) else ""
        self.sent = len(self.stream.text)
        return delta

    def final_text(self) -> str:
        text = self.info.detokenize(self.ids)
        base = len(self.info.detokenize(self.ids[: self.min_tokens])) if self.min_tokens else 0
        cut = stop_string_at(text, self.stop, base)
        return text[:cut] if cut >= 0 else text
