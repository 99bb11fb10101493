"""What a caller hands the engine (GenerationRequest) and gets back (StepOutput per round, GenerationResult at the
end), and the engine's state per live sequence between rounds (SequenceState)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .logprobs import TokenLogprob
from .processors import LogitsProcessor
from .stop_strings import StopScan
from .types import SamplingParams, SequenceMetrics


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to decode: its prompt, limits, sampling, stop rules, logprobs and processors."""

    seq_id: str
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # Stop strings count only where they end after this many generated tokens (vLLM's min_tokens; the stop ids are
    # banned until then by the request's MinTokens processor).
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; 0: the chosen token's logprob; n: also the top-n (core/logprobs.py)
    prompt_logprobs: bool = False  # score the prompt in the first round (top-n as `logprobs`)
    speculate: bool = True  # False: plain target steps for this sequence (no draft, no lookup), the per-request opt-out
    # Applied to every target row with that row's own history (core/processors.py): penalties, biases, bans, grammar.
    processors: tuple[LogitsProcessor, ...] = ()
    # Whose earlier outputs this request drafts from and adds its own to (core/suffix.py): "" is the shared scope;
    # the server passes one per API key when the store is scoped.
    suffix_scope: str = ""
    # The LoRA adapter of the target this request decodes with ("" the base): verified per row (core/lora.py); the
    # draft is the base's for every adapter.
    adapter: str = ""
    # The draft's exit thresholds for this request's rows (an adapter's calibration profile); None: the drafter's.
    draft_thresholds: tuple[float, ...] | None = None


@dataclass
class StepOutput:
    """Tokens a sequence gained in one round (after stop truncation), and whether it finished."""

    seq_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    metrics: dict | None = None  # the sequence's SequenceMetrics.to_dict(), once it finished
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first round only, when the request asked


@dataclass
class GenerationResult:
    """A finished sequence, as `SpecEngine.generate` returns it."""

    seq_id: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict[str, Any]
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class SequenceState:
    """What the engine keeps per live sequence between rounds."""

    req: GenerationRequest
    k: int
    generated: list[int] = field(default_factory=list)
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set once the prompt was scored
    prefilled: int = 0  # prompt positions sent to the verifier in earlier rounds' chunks (chunked prefill)
    stops: StopScan | None = None  # the stop-string search over its completion, round by round (with stop strings)

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt_ids + self.generated
