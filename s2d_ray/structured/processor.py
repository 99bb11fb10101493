"""GrammarProcessor: the LogitsProcessor (core/processors.py) that bans every token the grammar does not allow next.

Each row is masked with its own history: one matcher follows the committed tokens (advanced lazily: `committed` only
grows for one sequence), and for every row it consumes that row's branch, computes the mask, and rolls back. Rows
come parent before child (a chain's prefixes, a tree's node paths), so consecutive branches share their prefix and the
matcher rolls back only to where they part. Once the grammar is complete only the stop tokens are allowed.

A matcher that refuses a rollback (or errs) would stay ahead of the history and mask every later row for the wrong
prefix, and its errors survive `reset()`: it is then rebuilt from the grammar and replayed over the committed tokens.
The mask is built on the host (llguidance writes host memory) and moved to the logits' device once.
"""

from __future__ import annotations

from typing import Sequence

import llguidance.torch as llt
import torch

from .grammars import CompiledGrammar

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarProcessor:
    """One request's grammar mask. `stop_ids`: the request's stop tokens, allowed where the grammar may end (none,
    as with ignore_eos: the tokenizer's EOS, so the sequence runs on to its length limit)."""

    def __init__(self, grammar: CompiledGrammar, prompt_len: int, stop_ids: Sequence[int]) -> None:
        self.grammar = grammar
        self.matcher = grammar.matcher()
        self.prompt_len = prompt_len
        self.eos = grammar.tokenizer.eos_token
        self.vocab = grammar.tokenizer.vocab_size
        self.stop_ids = [int(s) for s in stop_ids] or [self.eos]
        self.history: list[int] = []  # generated tokens the matcher has consumed

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]],
                 logits: torch.Tensor) -> torch.Tensor:
        ok = self._advance(list(committed[self.prompt_len:]))
        bits = llt.allocate_token_bitmask(len(branches), self.vocab)
        valid = [False] * len(branches)
        if ok:
            valid = self._fill(branches, bits)
        allowed = self._allowed(bits, valid, logits.shape[1]).to(logits.device, non_blocking=True)
        out = logits.masked_fill(~allowed, float("-inf"))
        # A row where an earlier processor banned all the grammar allows (min_tokens) keeps the grammar's choice
        # (no host sync: a select on the logits' device).
        dead = ~torch.isfinite(out).any(dim=-1, keepdim=True)
        only = torch.zeros((), dtype=out.dtype, device=out.device).masked_fill(~allowed, float("-inf"))
        return torch.where(dead, only, out)

    def _advance(self, generated: list[int]) -> bool:
        """Follow the committed tokens; False if they break the grammar (the row may then only stop)."""
        n = len(self.history)
        if len(generated) < n or generated[:n] != self.history:  # not an extension: replay from the start
            self._rebuild([])
            n = 0
        new = generated[n:]
        if new:
            self.matcher.consume_tokens(new)
            self.history.extend(new)
        return not self.matcher.is_error()

    def _fill(self, branches: Sequence[Sequence[int]], bits: torch.Tensor) -> list[bool]:
        """Mask row i after branch i; rows whose branch the grammar rejects stay invalid."""
        valid, stack = [], []  # stack: branch tokens consumed beyond the committed ones
        for i, branch in enumerate(branches):
            branch = list(branch)
            common = 0
            while common < min(len(stack), len(branch)) and stack[common] == branch[common]:
                common += 1
            if len(stack) > common:
                self._rollback(len(stack) - common, stack[:common])
                del stack[common:]
            rest = branch[common:]
            taken = self.matcher.try_consume_tokens(rest) if rest else 0
            stack.extend(rest[:taken])
            good = taken == len(rest) and not self.matcher.is_error()
            if good:
                llt.fill_next_token_bitmask(self.matcher, bits, i)
            valid.append(good)
        if stack:
            self._rollback(len(stack), [])
        return valid

    def _rollback(self, n: int, kept: list[int]) -> None:
        """Undo the last n branch tokens, leaving `kept` (the branch tokens before them) consumed; a matcher that
        refuses (or is left in error) is rebuilt at the history and replays `kept`."""
        if not self.matcher.rollback(n) or self.matcher.is_error():
            self._rebuild(self.history)
            if kept:
                self.matcher.consume_tokens(kept)

    def _rebuild(self, history: list[int]) -> None:
        """A fresh matcher (errors are sticky across `reset()`) advanced over `history`."""
        history = list(history)
        self.matcher = self.grammar.matcher()
        if history:
            self.matcher.consume_tokens(history)
        self.history = history

    def _allowed(self, bits: torch.Tensor, valid: list[bool], width: int) -> torch.Tensor:
        """Bool [n, width]: the grammar's tokens; its EOS stands for every stop token; invalid rows only stop."""
        words = ((bits.unsqueeze(-1) >> _BITS) & 1).bool().view(bits.shape[0], -1)[:, : min(self.vocab, width)]
        allowed = torch.zeros((bits.shape[0], width), dtype=torch.bool)
        allowed[:, : words.shape[1]] = words
        ends = allowed[:, self.eos].clone() | ~torch.tensor(valid, dtype=torch.bool)
        allowed[~torch.tensor(valid, dtype=torch.bool)] = False
        allowed[:, self.eos] = False
        stops = torch.tensor(self.stop_ids)
        allowed[ends.nonzero().flatten().unsqueeze(-1), stops.unsqueeze(0)] = True
        return allowed
