"""Drafting from earlier outputs: a bounded store of recently generated token sequences, searched by the longest
suffix of a sequence's recent tokens (the idea of SuffixDecoding, as in Arctic Inference).

Agentic and evaluation traffic repeats whole outputs (retries, tool-call skeletons, a turn quoting an earlier
answer); prompt lookup (core/lookup.py) sees only the request's own text. The store keeps each finished output with
the last `max_ngram` tokens of its prompt before it (so an output's first tokens can match the end of a prompt such
as a chat template's assistant header), and proposes what followed the best match. Prompts themselves are not kept:
the request's own lookup already drafts from its prompt, and a prompt is the text a client most often wants private.

Candidates are chosen from earlier text only, never from this round's acceptance coins, so they are deterministic
and join a token tree under the same exact acceptance as lookup's (core/tree.py): a wrong candidate costs a verified
position, never a wrong token.

Index: hash chains over token pairs, as LZ77 compressors find matches. `heads` maps the hash of (scope, a, b) to the
newest stored position holding the pair (a, b); every position links to the previous one with the same hash. A
lookup walks at most `max_chain` links from the newest and extends each hit backwards, comparing tokens, to its real
suffix length (so a hash collision only costs a miss; the scope is compared too, so scopes never mix). Memory is two
ints per stored token plus at most one dict entry per token; a lookup costs microseconds. Eviction drops the oldest
whole sequence: links only point to older positions, so a walk stops at the first evicted one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .types import DraftRequest

MIN_NGRAM = 2  # one shared token says little about what follows in another request's output
_INDEX_BITS = 32  # a position packs (sequence key << _INDEX_BITS) | index into one int
_INDEX_MASK = (1 << _INDEX_BITS) - 1


@dataclass(frozen=True)
class SuffixSpec:
    """How large the store is and what it proposes.

    `max_tokens`: stored tokens (outputs and their prompt tails) over all scopes; the oldest sequences go first.
    `max_ngram`: the longest suffix compared (also the prompt tail kept before each output). `num_tokens`: tokens
    proposed per candidate. `candidates`: distinct continuations per round. `alone_ngram`: a match at least this long
    is proposed without running the draft model that round. `max_chain`: earlier occurrences compared per lookup.
    """

    max_tokens: int
    max_ngram: int = 8
    num_tokens: int = 16
    candidates: int = 1
    alone_ngram: int = 8
    max_chain: int = 16

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"suffix store max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_ngram < MIN_NGRAM:
            raise ValueError(f"suffix store max_ngram must be >= {MIN_NGRAM}, got {self.max_ngram}")


@dataclass(frozen=True)
class SuffixMatch:
    tokens: list[int]  # the continuation proposed
    ngram: int  # length of the suffix it matched (>= MIN_NGRAM)


class _Stored:
    __slots__ = ("scope", "tokens", "prev")

    def __init__(self, scope: str, tokens: list[int], prev: list[int]) -> None:
        self.scope, self.tokens, self.prev = scope, tokens, prev


class SuffixStore:
    """Recent outputs by scope (one store per target engine; `scope` "" is everyone's), bounded in tokens."""

    def __init__(self, spec: SuffixSpec) -> None:
        self.spec = spec
        self._seqs: OrderedDict[int, _Stored] = OrderedDict()  # key -> sequence, oldest first
        self._heads: dict[int, int] = {}  # hash of (scope, a, b) -> newest packed position of the pair
        self._next_key = 0
        self.num_tokens = 0
        self.queries = self.matched = 0

    # --- writing ---------------------------------------------------------------------------------------------
    def finished(self, scope: str, prompt: list[int], output: list[int]) -> bool:
        """Keep a finished output after the tail of its prompt; False when there is nothing to keep."""
        if not output:
            return False
        return self.add(scope, list(prompt[-self.spec.max_ngram:]) + list(output))

    def add(self, scope: str, tokens: list[int]) -> bool:
        """Keep `tokens`, evicting the oldest sequences past `max_tokens`. A sequence too short to match and be
        continued, or longer than the whole store, is not kept."""
        n = len(tokens)
        if n < MIN_NGRAM + 1 or n > self.spec.max_tokens:
            return False
        key = self._next_key
        self._next_key += 1
        base = key << _INDEX_BITS
        prev = [-1] * n
        heads = self._heads
        for i in range(MIN_NGRAM - 1, n - 1):  # the pair ends at i; what follows starts at i + 1
            h = hash((scope, tokens[i - 1], tokens[i]))
            prev[i] = heads.get(h, -1)
            heads[h] = base | i
        self._seqs[key] = _Stored(scope, list(tokens), prev)
        self.num_tokens += n
        while self.num_tokens > self.spec.max_tokens:
            self._evict_oldest()
        return True

    def _evict_oldest(self) -> None:
        key, stored = self._seqs.popitem(last=False)
        self.num_tokens -= len(stored.tokens)
        base, toks, heads = key << _INDEX_BITS, stored.tokens, self._heads
        for i in range(MIN_NGRAM - 1, len(toks) - 1):
            h = hash((stored.scope, toks[i - 1], toks[i]))
            if heads.get(h) == base | i:  # no newer position holds the pair: the entry would only point at nothing
                del heads[h]

    # --- reading ---------------------------------------------------------------------------------------------
    def matches(self, req: DraftRequest) -> list[SuffixMatch]:
        """The candidates for one draft request (its scope, its tokens), best first."""
        return self.propose(req.suffix_scope, req.tokens)

    def propose(self, scope: str, context: list[int], num_tokens: int | None = None,
                candidates: int | None = None) -> list[SuffixMatch]:
        """Up to `candidates` distinct continuations of `context` from this scope's stored sequences: the longest
        matching suffix first (ties: the longer continuation, then the most recent), each cut to `num_tokens`. A continuation that is a
        prefix of one already taken adds nothing to a tree and is skipped."""
        num_tokens = num_tokens or self.spec.num_tokens
        candidates = candidates or self.spec.candidates
        self.queries += 1
        if len(context) < MIN_NGRAM:
            return []
        hits = self._walk(scope, context)
        # Longest match first; among equal ones the longer continuation (one the end of its output cuts short
        # proposes less), then the newest (the sort is stable).
        hits.sort(key=lambda hit: (-hit[0], -min(len(hit[1].tokens) - hit[2] - 1, num_tokens)))
        out: list[SuffixMatch] = []
        for n, stored, i in hits:
            cont = stored.tokens[i + 1:i + 1 + num_tokens]
            if cont and not any(m.tokens[:len(cont)] == cont for m in out):
                out.append(SuffixMatch(cont, n))
                if len(out) >= candidates:
                    break
        self.matched += bool(out)
        return out

    def _walk(self, scope: str, context: list[int]) -> list[tuple[int, _Stored, int]]:
        """(suffix length, sequence, index the match ends at) of up to `max_chain` earlier occurrences of the
        context's last pair in this scope, newest first."""
        hits = []
        pos = self._heads.get(hash((scope, context[-2], context[-1])), -1)
        for _ in range(self.spec.max_chain):
            if pos < 0:
                break
            stored = self._seqs.get(pos >> _INDEX_BITS)
            if stored is None:  # evicted: every older link is too
                break
            i = pos & _INDEX_MASK
            if stored.scope == scope:
                n = _suffix_length(context, stored.tokens, i, self.spec.max_ngram)
                if n >= MIN_NGRAM:
                    hits.append((n, stored, i))
            pos = stored.prev[i]
        return hits

    def stats(self) -> dict:
        return {"suffix_tokens": self.num_tokens, "suffix_max_tokens": self.spec.max_tokens,
                "suffix_sequences": len(self._seqs), "suffix_queries": self.queries, "suffix_matches": self.matched}

    def __len__(self) -> int:
        return len(self._seqs)


def _suffix_length(context: list[int], tokens: list[int], end: int, limit: int) -> int:
    """How many tokens ending at context[-1] equal those ending at tokens[end] (at most `limit`)."""
    n = 0
    top = min(limit, len(context), end + 1)
    while n < top and context[-1 - n] == tokens[end - n]:
        n += 1
    return n
