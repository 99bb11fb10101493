"""Sampling penalties, biases and bans as logits processors (core/processors.py), each row with its own history.

The formulas follow the APIs clients know:
- frequency / presence (OpenAI): over the tokens GENERATED so far (the prompt does not count),
  logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty;
- repetition (vLLM, as transformers' `RepetitionPenaltyLogitsProcessor`): over prompt + generated tokens, a seen
  token's logit is divided by r when positive and multiplied by r otherwise;
- logit_bias (OpenAI): added to the token's logit;
- min_tokens (vLLM): the stop ids are banned (-inf) until that many tokens were generated;
- bad_words (vLLM): a token-id sequence is never generated: its last token is banned where the generated tokens
  end with the rest of it (a one-token word is banned everywhere).
They run in vLLM's order: bad words, min_tokens, logit_bias, then the penalties. Counts are built per call with
bincount / scatter_add over the history (no loop over the vocabulary), so a processor is a pure function of the
row's history and stays exact under speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from .processors import LogitsProcessor


@dataclass(frozen=True)
class PenaltySpec:
    """A request's penalties, declarative and picklable; the defaults change nothing."""

    frequency_penalty: float = 0.0  # OpenAI: logit[j] -= count_generated[j] * frequency_penalty
    presence_penalty: float = 0.0  # OpenAI: logit[j] -= (count_generated[j] > 0) * presence_penalty
    repetition_penalty: float = 1.0  # vLLM: over prompt + output tokens; logit > 0 -> / r, else * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # stop ids banned until this many tokens were generated
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences never generated

    @property
    def active(self) -> bool:
        """Whether any field changes the logits (an inactive spec needs no processor)."""
        return self != PenaltySpec()


def penalty_processors(spec: PenaltySpec, prompt_len: int, stop_ids: Sequence[int]) -> tuple[LogitsProcessor, ...]:
    """The processors `spec` asks for, in vLLM's order; () when it asks for nothing (the engine's free path).

    `prompt_len` splits each history into prompt and generated tokens; `stop_ids` are the ids min_tokens bans.
    """
    out: list[LogitsProcessor] = []
    if spec.bad_words:
        out.append(BadWords(prompt_len, tuple(tuple(w) for w in spec.bad_words if w)))
    if spec.min_tokens > 0 and stop_ids:
        out.append(MinTokens(prompt_len, spec.min_tokens, tuple(stop_ids)))
    if spec.logit_bias:
        out.append(LogitBias(tuple(spec.logit_bias)))
    if spec.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(spec.repetition_penalty))
    if spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0:
        out.append(FrequencyPresence(prompt_len, spec.frequency_penalty, spec.presence_penalty))
    return tuple(out)


def token_counts(committed: Sequence[int], branches: Sequence[Sequence[int]], start: int, vocab: int,
                 device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per row, how often each token occurs in (committed + branches[i])[start:] -> [n, vocab]."""
    n = len(branches)
    base = torch.zeros(vocab, dtype=dtype, device=device)
    head = committed[start:]
    if head:
        ids = torch.tensor(head, dtype=torch.long, device=device)
        base.scatter_add_(0, ids, torch.ones(len(head), dtype=dtype, device=device))
    counts = base.expand(n, vocab).clone()
    skip = max(start - len(committed), 0)  # a prompt longer than committed (never in the engine): skip branch heads
    tails = [list(b[skip:]) for b in branches]
    width = max((len(t) for t in tails), default=0)
    if width:
        # Pad with an extra column (id `vocab`) that is dropped afterwards: one scatter for every row.
        padded = torch.full((n, width), vocab, dtype=torch.long)
        for i, t in enumerate(tails):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        padded = padded.to(device)
        extra = torch.zeros(n, vocab + 1, dtype=dtype, device=device)
        extra.scatter_add_(1, padded, torch.ones(padded.shape, dtype=dtype, device=device))
        counts += extra[:, :vocab]
    return counts


@dataclass(frozen=True)
class FrequencyPresence:
    """OpenAI's frequency and presence penalties over the generated tokens of each row's history."""

    prompt_len: int
    frequency: float
    presence: float
    bans: ClassVar[bool] = False  # finite shifts only: the engine need not probe it for banned candidates

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:  # logits: [n, V]
        # Counts and shifts in float32 at least: a bf16 row cannot hold a count past 256 exactly.
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        counts = token_counts(committed, branches, self.prompt_len, logits.shape[-1], logits.device, dtype)
        shift = counts * self.frequency + (counts > 0).to(dtype) * self.presence
        return (logits.to(dtype) - shift).to(logits.dtype)


@dataclass(frozen=True)
class RepetitionPenalty:
    """vLLM's repetition penalty over prompt + generated tokens: seen logits > 0 divided by r, others times r."""

    penalty: float
    bans: ClassVar[bool] = False

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:  # logits: [n, V]
        seen = token_counts(committed, branches, 0, logits.shape[-1], logits.device, torch.float32) > 0
        scaled = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        # A tiny penalty overflows a positive logit to +inf, and a softmax over +inf is NaN: keep it finite, with room
        # for the smallest sampled temperature (1e-5) to divide it again.
        scaled = scaled.clamp(max=torch.finfo(logits.dtype).max * 1e-6)
        return torch.where(seen, scaled, logits)


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's logit_bias: a fixed value added to listed tokens' logits (history-free)."""

    bias: tuple[tuple[int, float], ...]

    @property
    def bans(self) -> bool:
        """Only a -inf bias bans a token (the HTTP range is [-100, 100], but the core takes any float)."""
        return any(v == float("-inf") for _, v in self.bias)

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:  # logits: [n, V]
        ids = torch.tensor([t for t, _ in self.bias], dtype=torch.long, device=logits.device)
        values = torch.tensor([v for _, v in self.bias], dtype=logits.dtype, device=logits.device)
        out = logits.clone()
        out.index_add_(1, ids, values.expand(logits.shape[0], -1).contiguous())
        return out


@dataclass(frozen=True)
class MinTokens:
    """vLLM's min_tokens: the stop ids are -inf in rows with fewer than `min_tokens` generated tokens."""

    prompt_len: int
    min_tokens: int
    stop_ids: tuple[int, ...]

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:  # logits: [n, V]
        done = len(committed) - self.prompt_len
        short = [done + len(b) < self.min_tokens for b in branches]
        if not any(short):
            return logits
        rows = torch.tensor(short, device=logits.device)[:, None]
        cols = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        cols[[t for t in self.stop_ids if t < logits.shape[-1]]] = True
        return logits.masked_fill(rows & cols, float("-inf"))


@dataclass(frozen=True)
class BadWords:
    """vLLM's bad_words: a word's last token is -inf where the generated tokens end with the rest of the word."""

    prompt_len: int
    words: tuple[tuple[int, ...], ...]

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:  # logits: [n, V]
        longest = max((len(w) for w in self.words), default=1) - 1
        generated = committed[self.prompt_len:]
        head = list(generated[max(len(generated) - longest, 0):]) if longest else []
        rows, cols = [], []
        for i, branch in enumerate(branches):
            tail = (head + list(branch))[-longest:] if longest else []
            for word in self.words:
                m = len(word) - 1
                if m == 0 or (len(tail) >= m and tuple(tail[len(tail) - m:]) == word[:-1]):
                    rows.append(i)
                    cols.append(word[-1])
        if not rows:
            return logits
        return logits.index_put((torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)),
                                torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
