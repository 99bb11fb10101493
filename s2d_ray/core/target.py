"""The verifier: target logits for committed + draft tokens of many sequences in one batched forward."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .stack import LayerStack, RowTable, decoder_parts, pending_grid
from .types import ScoreRequest


def widen(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits to float32 for sampling; float32/float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class Verifier(Protocol):
    """The scorer role: target logits at the last `num_logits` positions of each request's tokens."""

    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]: ...

    def release(self, seq_id: str) -> None: ...


class TargetVerifier:
    """Runs a Hugging Face causal LM's layers over a slot cache; per-sequence KV, rollback by prefix sync.

    Works unchanged on a model whose Linear layers DeepSpeed AutoTP has sharded: every rank calls `score` with the
    same requests and rank 0's logits are the answer.
    """

    def __init__(self, model: nn.Module) -> None:
        parts = decoder_parts(model)
        self.model = model
        self.stack = LayerStack(parts, [len(parts.layers)])
        self.cache = self.stack.new_cache()
        self.table = RowTable(1, self.cache)
        self.vocab_size = model.config.vocab_size

    @torch.no_grad()
    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        """One forward over every request's uncached positions; returns logits [num_logits, V] per request."""
        if not requests:
            return []
        states, starts, ends = [], [], []
        for req in requests:
            if req.num_logits < 1 or req.num_logits > len(req.tokens):
                raise ValueError(f"num_logits must be in [1, {len(req.tokens)}], got {req.num_logits}")
            st = self.table.sync(req.seq_id, req.tokens)
            # Positions whose logits are wanted must be recomputed even if their KV is cached.
            st.filled[0] = min(st.filled[0], len(req.tokens) - req.num_logits)
            states.append(st)
            starts.append(st.filled[0])
            ends.append(len(req.tokens) - 1)
        device = self.stack.device
        positions, valid = pending_grid(starts, ends, device)
        ids = torch.zeros(positions.shape, dtype=torch.long, device=device)
        for i, (req, st) in enumerate(zip(requests, states)):
            n = ends[i] - starts[i] + 1
            ids[i, :n] = torch.tensor(req.tokens[starts[i] :], device=device)
        rows = torch.tensor([st.row for st in states], device=device)
        hidden = self.stack.run_segment(0, self.stack.embed(ids), rows, positions, self.cache)
        picked = [hidden[i, e - s + 1 - req.num_logits : e - s + 1] for i, (req, s, e) in enumerate(zip(requests, starts, ends))]
        logits = widen(self.stack.logits(torch.cat(picked)))  # one LM-head matmul for the whole batch
        for st, req in zip(states, requests):
            st.filled[0] = len(req.tokens)
        return list(logits.split([req.num_logits for req in requests]))

    def release(self, seq_id: str) -> None:
        self.table.release(seq_id)

    @property
    def num_active(self) -> int:
        return len(self.table)
