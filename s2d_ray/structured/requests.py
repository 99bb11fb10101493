"""From a request's fields to the engine's stop ids and logits processors, shared by the server and `s2d generate`:
token ids checked against the vocabulary (a RequestError naming the field), penalties as core/penalties.py's
PenaltySpec, the grammar compiled (cached) and masked last, after every penalty and bias."""

from __future__ import annotations

from typing import Sequence

from ..core.penalties import PenaltySpec, penalty_processors
from ..core.processors import LogitsProcessor
from ..errors import RequestError
from .grammars import GrammarSpec, compile_grammar
from .processor import GrammarProcessor


def check_ids(ids: Sequence[int], vocab: int, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param)


def stop_ids(eos_ids: Sequence[int], stop_token_ids: Sequence[int] | None, ignore_eos: bool,
             vocab: int) -> tuple[int, ...]:
    """The ids that end a sequence: EOS unless ignore_eos, then the request's own (kept even with ignore_eos)."""
    extra = list(stop_token_ids or [])
    check_ids(extra, vocab, "stop_token_ids")
    ids = ([] if ignore_eos else list(eos_ids)) + extra
    return tuple(dict.fromkeys(ids))


def bias_pairs(logit_bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as sorted (id, bias) pairs, ids checked."""
    pairs = tuple(sorted((int(k), float(v)) for k, v in (logit_bias or {}).items()))
    check_ids([i for i, _ in pairs], vocab, "logit_bias")
    return pairs


def bad_word_ids(tokenizer, words: Sequence[str] | None) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequence, alone and after a space (as vLLM bans both spellings)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words or []:
        if not word:
            raise RequestError("bad_words: empty string", "bad_words")
        for text in (word, " " + word.lstrip(" ")):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def request_processors(tokenizer, prompt_len: int, stops: Sequence[int], penalties: PenaltySpec,
                       grammar: GrammarSpec | None) -> tuple[LogitsProcessor, ...]:
    """The processors of one sequence, in order: penalties and biases, then the grammar (its mask is the last word:
    a bias cannot bring a token the grammar bans back)."""
    procs: tuple[LogitsProcessor, ...] = ()
    if penalties.active:
        procs = tuple(penalty_processors(penalties, prompt_len, stops))
    if grammar is not None:
        procs += (GrammarProcessor(compile_grammar(grammar, tokenizer), prompt_len, stops),)
    return procs
