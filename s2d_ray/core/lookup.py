"""Free candidates: prompt lookup (n-gram matching over the sequence itself), and the drafter that combines it with
the sorted draft into one token tree per sequence.

Lookup costs no model forward: find the longest suffix of the sequence (up to `max_ngram` tokens) that occurred
earlier, and propose what followed its most recent occurrence (transformers' prompt_lookup_num_tokens; Saxena 2023).
Its candidates are deterministic, so they join a tree under the same exact acceptance as the draft's (core/tree.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .tree import LOOKUP, TokenTree
from .types import DraftRequest, Proposal


@dataclass(frozen=True)
class LookupMatch:
    tokens: list[int]  # the continuation proposed
    ngram: int  # length of the matched suffix (0: no match)


def find_continuation(tokens: list[int], max_ngram: int, num_tokens: int, min_ngram: int = 1) -> LookupMatch:
    """The continuation of the most recent earlier occurrence of the longest matching suffix."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        first = suffix[0]
        # Most recent occurrence first; the match must end before the suffix itself starts.
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + num_tokens]
                if cont:
                    return LookupMatch(cont, n)
    return LookupMatch([], 0)


class PromptLookup:
    """The lookup drafter: a chain of up to `num_tokens` candidates per sequence, behind the Drafter contract."""

    def __init__(self, max_ngram: int = 4, num_tokens: int = 10) -> None:
        self.max_ngram, self.num_tokens = max_ngram, num_tokens

    def match(self, req: DraftRequest) -> LookupMatch:
        return find_continuation(req.tokens, self.max_ngram, self.num_tokens)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for req in requests:
            cont = self.match(req).tokens
            out.append(Proposal(cont, None, [LOOKUP] * len(cont), list(range(-1, len(cont) - 1)), [0.0] * len(cont)))
        return out

    def release(self, seq_id: str) -> None:
        """Stateless: nothing to free."""


class TreeDrafter:
    """Lookup + sorted draft, merged into one token tree per sequence (configuration, not a code path).

    A sequence whose lookup match is at least `alone_ngram` tokens long is proposed from lookup alone, without the
    draft forward (TensorRT-LLM's hybrid rule); the others get the draft's tree with the lookup chain merged in.
    `draft` may be in-process or remote (its propose may return an awaitable; then so does this one).
    """

    def __init__(self, draft: Any | None, lookup: PromptLookup | None, alone_ngram: int = 4) -> None:
        self.draft, self.lookup, self.alone_ngram = draft, lookup, alone_ngram

    def propose(self, requests: list[DraftRequest]) -> Any:
        matches = [self.lookup.match(r) if self.lookup and r.tree else LookupMatch([], 0) for r in requests]
        need = [i for i, (r, m) in enumerate(zip(requests, matches))
                if self.draft is not None and r.k > 0 and not (m.tokens and m.ngram >= self.alone_ngram)]
        sub = [requests[i] for i in need]
        drafted = self.draft.propose(sub) if sub else []
        if inspect.isawaitable(drafted):
            async def finish() -> list[Proposal]:
                return _merge(requests, matches, need, await drafted)
            return finish()
        return _merge(requests, matches, need, drafted)

    def release(self, seq_id: str) -> None:
        if self.draft is not None:
            self.draft.release(seq_id)


def _merge(requests: list[DraftRequest], matches: list[LookupMatch], need: list[int],
           drafted: list[Proposal]) -> list[Proposal]:
    out = [Proposal.empty() for _ in requests]
    for i, prop in zip(need, drafted):
        out[i] = prop
    for i, (req, m) in enumerate(zip(requests, matches)):
        if not req.tree:
            continue
        tree = TokenTree()
        prop = out[i]
        if prop.tokens:
            parents = prop.parents if prop.parents is not None else list(range(-1, len(prop.tokens) - 1))
            scores = prop.scores if prop.scores is not None else [1.0] * len(prop.tokens)
            index: dict[int, int] = {}
            for j, (tok, par, ex, sc) in enumerate(zip(prop.tokens, parents, prop.exits, scores)):
                index[j] = tree.add(index.get(par, -1), tok, ex, sc)
        if m.tokens:
            tree.add_path(m.tokens, [LOOKUP] * len(m.tokens), [0.0] * len(m.tokens))
        out[i] = Proposal(tree.tokens, None, tree.exits, tree.parents, tree.scores)
    return out
