"""Several plain greedy steps in one verifier call (`ScoreRequest.steps`).

A served round pays a call to the target deployment on top of its forward; a plain greedy row (no draft, argmax only)
can take several of its own argmax tokens per call instead of one. Each step is an ordinary verifier call over the rows
still stepping, so the tokens are the target's greedy choices exactly as one step per call would make them; a row stops
at its step count or at a stop id (the engine's `_append` still applies every stop rule, so tokens past a stop are
dropped there).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .calls import Calls, drive
from .sampling import argmax_ids
from .types import ScoreRequest

# A verifier's `score`: logits (or argmax ids) per request, or an awaitable of them (a deployment client).
Score = Callable[[list[ScoreRequest]], Any]


def score_steps(score: Score, requests: list[ScoreRequest]) -> list[torch.Tensor]:
    """`stepped_scores` with an in-process `score`."""
    return drive(stepped_scores(score, requests))


def stepped_scores(score: Score, requests: list[ScoreRequest]) -> Calls[list[torch.Tensor]]:
    """`score(requests)`, then for every row asking `steps > 1` more greedy steps; such a row's answer is the ids it
    chose ([n <= steps] integers), every other row's is what `score` gave it. A row `score` already answered with ids
    (a remote verifier that took its steps itself, `serve/replica.score_counted`) is left as it is. Yields each
    `score` call's answer (see core/calls.py)."""
    for r in requests:
        if r.steps > 1 and not (r.argmax_only and r.num_logits == 1 and r.parents is None):
            raise ValueError(f"{r.seq_id}: steps > 1 needs a plain greedy row (argmax_only, one logit, no tree)")
    out = list((yield score(requests)))
    multi = [i for i, r in enumerate(requests) if r.steps > 1 and out[i].dim() == 2]
    chosen = {i: [argmax_ids(out[i])[-1]] for i in multi}
    while True:
        live = [i for i in multi if len(chosen[i]) < requests[i].steps and chosen[i][-1] not in requests[i].stop_ids]
        if not live:
            break
        nxt = yield score([ScoreRequest(requests[i].seq_id, requests[i].tokens + chosen[i], 1, argmax_only=True,
                                       adapter=requests[i].adapter)
                           for i in live])
        for i, x in zip(live, nxt):
            chosen[i].append(argmax_ids(x)[-1])
    for i in multi:
        out[i] = torch.tensor(chosen[i], dtype=torch.long)
    return out
