"""Free candidates: prompt lookup (n-gram matching over the sequence itself), and the drafter that combines it and
earlier outputs (core/suffix.py) with the sorted draft into one token tree per sequence.

Lookup costs no model forward: find the longest suffix of the sequence (up to `max_ngram` tokens) that occurred
earlier, and propose what followed its most recent occurrence (transformers' prompt_lookup_num_tokens; Saxena 2023).
Other occurrences often continue differently; with `candidates` > 1 the next distinct continuations (older
occurrences of the same suffix, then of shorter ones) join the tree as short branches (`branch_tokens` each): a tree
verifies them in the same forward, where a chain has to bet on one. Candidates are deterministic, so they join a tree
under the same exact acceptance as the draft's (core/tree.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .suffix import SuffixMatch, SuffixStore
from .tree import LOOKUP, LOOKUP_BRANCH, TokenTree
from .types import DraftRequest, Proposal


@dataclass(frozen=True)
class LookupMatch:
    tokens: list[int]  # the continuation proposed
    ngram: int  # length of the matched suffix (0: no match)


def find_continuation(tokens: list[int], max_ngram: int, num_tokens: int, min_ngram: int = 1) -> LookupMatch:
    """The continuation of the most recent earlier occurrence of the longest matching suffix."""
    found = find_continuations(tokens, max_ngram, num_tokens, 1, min_ngram=min_ngram)
    return found[0] if found else LookupMatch([], 0)


def find_continuations(tokens: list[int], max_ngram: int, num_tokens: int, candidates: int = 1,
                       branch_tokens: int | None = None, min_ngram: int = 1) -> list[LookupMatch]:
    """Up to `candidates` distinct continuations, best first: the first is `find_continuation`'s; the others follow
    older occurrences of the same suffix, then of shorter suffixes, cut to `branch_tokens`. A continuation that is a
    prefix of one already taken adds nothing to a tree and is skipped."""
    n_tok = len(tokens)
    found: list[LookupMatch] = []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        first = suffix[0]
        # Most recent occurrence first; the match must end before the suffix itself starts.
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] != first or tokens[start:start + n] != suffix:
                continue
            length = num_tokens if not found else min(num_tokens, branch_tokens or num_tokens)
            cont = tokens[start + n:start + n + length]
            if cont and not any(m.tokens[:len(cont)] == cont for m in found):
                found.append(LookupMatch(cont, n))
                if len(found) >= candidates:
                    return found
    return found


class PromptLookup:
    """The lookup drafter: up to `candidates` continuations per sequence (the first up to `num_tokens` long, the
    others `branch_tokens`), merged into one tree, behind the Drafter contract."""

    def __init__(self, max_ngram: int = 4, num_tokens: int = 10, candidates: int = 1, branch_tokens: int = 3) -> None:
        self.max_ngram, self.num_tokens = max_ngram, num_tokens
        self.candidates, self.branch_tokens = candidates, branch_tokens

    def matches(self, req: DraftRequest) -> list[LookupMatch]:
        """The candidates for one sequence, best first (empty: no match)."""
        return find_continuations(req.tokens, self.max_ngram, self.num_tokens, self.candidates, self.branch_tokens)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for req in requests:
            tree = TokenTree()
            add_lookup(tree, self.matches(req))
            out.append(tree.proposal())
        return out

    def release(self, seq_id: str) -> None:
        """Stateless: nothing to free."""


class TreeDrafter:
    """Lookup + earlier outputs + sorted draft, merged into one token tree per sequence (configuration, not a code
    path).

    A sequence whose lookup match is at least `alone_ngram` tokens long (or whose match in the store of earlier
    outputs is at least the store's `alone_ngram`) is proposed from those candidates alone, without the draft forward
    (TensorRT-LLM's hybrid rule); the others get the draft's tree with the candidates merged in. `draft` may be
    in-process or remote (its propose may return an awaitable; then so does this one).
    """

    def __init__(self, draft: Any | None, lookup: PromptLookup | None, alone_ngram: int = 4,
                 suffix: SuffixStore | None = None) -> None:
        self.draft, self.lookup, self.alone_ngram, self.suffix = draft, lookup, alone_ngram, suffix

    def propose(self, requests: list[DraftRequest]) -> Any:
        matches, alone = [], []
        for r in requests:
            own = self.lookup.matches(r) if self.lookup and r.tree else []
            stored = self.suffix.matches(r) if self.suffix is not None and r.tree else []
            alone.append(bool(own and own[0].ngram >= self.alone_ngram)
                         or bool(stored and stored[0].ngram >= self.suffix.spec.alone_ngram))
            matches.append(merge_matches(own, stored))
        need = [i for i, r in enumerate(requests) if self.draft is not None and r.k > 0 and not alone[i]]
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


def merge_matches(own: list[LookupMatch], stored: list[SuffixMatch]) -> list[LookupMatch | SuffixMatch]:
    """The request's own lookup candidates and the store's as one list, the longest matched suffix first (ties: the
    request's own text first); a continuation that is a prefix of one already taken is dropped."""
    if not stored:
        return own
    out: list[LookupMatch | SuffixMatch] = []
    for m in sorted(own + stored, key=lambda m: -m.ngram):
        if not any(o.tokens[:len(m.tokens)] == m.tokens for o in out):
            out.append(m)
    return out


def add_lookup(tree: TokenTree, matches: list[LookupMatch | SuffixMatch]) -> None:
    """Lookup candidates into a tree: the first continuation marked LOOKUP, the others LOOKUP_BRANCH (the budget
    learns their acceptance apart: an older occurrence's continuation is accepted less often); the tree records the
    first one's matched suffix length (`match_ngram`), by which the budget values the LOOKUP nodes."""
    if matches:
        tree.match_ngram = matches[0].ngram
    for rank, m in enumerate(matches):
        mark = LOOKUP if rank == 0 else LOOKUP_BRANCH
        tree.add_path(m.tokens, [mark] * len(m.tokens), [0.0] * len(m.tokens))


def _merge(requests: list[DraftRequest], matches: list[list[LookupMatch | SuffixMatch]], need: list[int],
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
        add_lookup(tree, m)
        out[i] = tree.proposal()
    return out
