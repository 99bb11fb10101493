"""The store of earlier outputs (core/suffix.py): what it proposes (against a slow reference), scopes, bounds,
eviction and the cost of a lookup; and its config."""

from __future__ import annotations

import random
import time

import pytest
from pydantic import ValidationError

from s2d_ray.config import EngineConfig, SuffixConfig
from s2d_ray.core.suffix import MIN_NGRAM, SuffixSpec, SuffixStore
from s2d_ray.core.types import DraftRequest, SamplingParams


def store(max_tokens: int = 10_000, **kw) -> SuffixStore:
    return SuffixStore(SuffixSpec(max_tokens, **kw))


def test_longest_suffix_first_then_most_recent():
    s = store(max_ngram=4, num_tokens=3, candidates=3)
    s.add("", [1, 2, 3, 4, 10, 11, 12, 13])
    s.add("", [9, 3, 4, 20, 21])  # newer, but matches only [3, 4]
    s.add("", [7, 3, 4, 30, 31, 32, 33])  # newest, [3, 4] again
    got = s.propose("", [0, 2, 3, 4])
    assert [(m.tokens, m.ngram) for m in got] == [([10, 11, 12], 3), ([30, 31, 32], 2), ([20, 21], 2)]
    assert s.propose("", [0, 2, 3, 4], candidates=1)[0].tokens == [10, 11, 12]
    assert s.propose("", [5, 6]) == []  # no pair in common
    assert s.propose("", [4]) == []  # shorter than MIN_NGRAM


def test_the_match_length_is_capped_and_a_prefix_of_a_taken_continuation_is_skipped():
    s = store(max_ngram=3, num_tokens=4, candidates=3)
    s.add("", [1, 2, 3, 4, 5, 6, 7])
    s.add("", [8, 3, 4, 5, 6])  # continuation [5, 6] is a prefix of [5, 6, 7]: adds nothing
    got = s.propose("", [1, 2, 3, 4])
    assert [(m.tokens, m.ngram) for m in got] == [([5, 6, 7], 3)]


def test_an_output_keeps_the_tail_of_its_prompt_so_its_first_tokens_match():
    s = store(max_ngram=3, num_tokens=5)
    prompt, output = [50, 51, 52, 53, 60, 61], [70, 71, 72, 73]
    assert s.finished("", prompt, output)
    assert s.num_tokens == 3 + len(output)  # the prompt's last max_ngram tokens, then the output
    m = s.propose("", [99, 53, 60, 61])[0]
    assert m.tokens == output and m.ngram == 3
    assert not s.finished("", prompt, [])


def test_scopes_never_see_each_others_outputs():
    s = store(num_tokens=4)
    s.add("key-a", [1, 2, 3, 4, 5, 6])
    assert s.propose("key-a", [1, 2, 3])[0].tokens == [4, 5, 6]
    assert s.propose("key-b", [1, 2, 3]) == []
    assert s.propose("", [1, 2, 3]) == []  # the shared scope is a scope of its own
    s.add("key-b", [1, 2, 3, 9, 9])
    assert s.propose("key-a", [1, 2, 3])[0].tokens == [4, 5, 6]
    assert s.propose("key-b", [1, 2, 3])[0].tokens == [9, 9]


def test_draft_requests_read_their_own_scope():
    s = store(num_tokens=2)
    s.add("k", [4, 5, 6, 7])
    req = DraftRequest("a", [1, 4, 5], 0, SamplingParams(), tree=True, suffix_scope="k")
    assert s.matches(req)[0].tokens == [6, 7]
    assert s.matches(DraftRequest("b", [1, 4, 5], 0, SamplingParams(), tree=True)) == []


def reference(seqs: list[tuple[str, list[int]]], scope: str, context: list[int], max_ngram: int,
              num_tokens: int) -> tuple[list[int], int] | None:
    """Slow reference: over every stored position (newest sequence and position first), the longest suffix match,
    then the longest continuation."""
    best, best_rank = None, None
    for sc, toks in reversed(seqs):
        if sc != scope:
            continue
        for end in range(len(toks) - 2, 0, -1):  # the match ends at `end`; something follows it
            n = 0
            while n < min(max_ngram, len(context), end + 1) and context[-1 - n] == toks[end - n]:
                n += 1
            cont = toks[end + 1:end + 1 + num_tokens]
            if n >= MIN_NGRAM and (best_rank is None or (n, len(cont)) > best_rank):
                best, best_rank = (cont, n), (n, len(cont))
    return best


def test_proposals_equal_a_slow_reference():
    rng = random.Random(0)
    s = store(max_ngram=5, num_tokens=4, max_chain=10_000)
    seqs = []
    for _ in range(60):
        scope = rng.choice(["", "a"])
        toks = [rng.randrange(6) for _ in range(rng.randrange(3, 30))]
        s.add(scope, toks)
        seqs.append((scope, toks))
    checked = 0
    for _ in range(300):
        scope = rng.choice(["", "a"])
        context = [rng.randrange(6) for _ in range(rng.randrange(2, 12))]
        got = s.propose(scope, context)
        want = reference(seqs, scope, context, 5, 4)
        assert (got[0].tokens, got[0].ngram) == want if want else got == []
        checked += want is not None and want[1] > 2
    assert checked > 20  # long matches were compared, not only pairs


def test_the_store_never_exceeds_its_size_and_evicts_oldest_whole_sequences():
    rng = random.Random(1)
    s = store(max_tokens=2_000, num_tokens=3)
    kept = []
    for i in range(3_000):  # a soak of distinct outputs
        toks = [1000 + i, 5000 + i] + [rng.randrange(50_000) for _ in range(rng.randrange(3, 60))]
        s.add("", toks)
        kept.append(toks)
        assert s.num_tokens <= 2_000
        assert len(s._heads) <= s.num_tokens  # at most one index entry per stored token
    assert s.num_tokens > 1_500
    held = sum(len(t) for t in kept[-len(s):])
    assert held == s.num_tokens  # the newest sequences, whole
    newest, oldest = kept[-1], kept[-len(s) - 1]
    assert s.propose("", newest[:2])[0].tokens == newest[2:5]
    assert s.propose("", oldest[:2]) == []  # evicted: its index entries went with it


def test_sequences_too_short_or_longer_than_the_store_are_not_kept():
    s = store(max_tokens=10)
    assert not s.add("", [1, 2])
    assert not s.add("", list(range(11)))
    assert s.add("", list(range(10))) and s.num_tokens == 10
    assert s.add("", [7, 8, 9]) and s.num_tokens == 3  # the first went whole
    assert s.stats()["suffix_sequences"] == 1


def test_a_lookup_costs_microseconds_even_where_a_pair_is_everywhere():
    rng = random.Random(2)
    s = store(max_tokens=200_000)
    for _ in range(2_000):  # every output holds the pair (1, 2) many times: the chain is as long as it gets
        s.add("", [t for _ in range(10) for t in (1, 2, rng.randrange(3, 1000), rng.randrange(3, 1000))])
    context = [rng.randrange(3, 1000) for _ in range(200)] + [1, 2]
    s.propose("", context)
    n = 2_000
    start = time.perf_counter()
    for _ in range(n):
        s.propose("", context)
    per_lookup = (time.perf_counter() - start) / n
    assert per_lookup < 300e-6  # a scan of the 80k stored tokens would take milliseconds


def test_config_requires_a_size_when_enabled():
    with pytest.raises(ValidationError, match="suffix.max_tokens is required"):
        SuffixConfig(enabled=True)
    with pytest.raises(ValidationError, match="suffix"):
        EngineConfig.model_validate({"suffix": {"enabled": True}})
    with pytest.raises(ValidationError):
        SuffixConfig(enabled=True, max_tokens=0)
    with pytest.raises(ValidationError):
        SuffixConfig(scope="everyone")
    assert SuffixConfig().spec() is None and not EngineConfig().suffix.enabled  # off by default
    spec = SuffixConfig(enabled=True, max_tokens=4096, max_ngram=6).spec()
    assert (spec.max_tokens, spec.max_ngram) == (4096, 6)


def test_the_cli_flag_enables_a_sized_store_and_refuses_a_zero_size():
    from s2d_ray.commands.engine_args import suffix_config
    from s2d_ray.errors import RequestError

    assert suffix_config(None) == SuffixConfig()
    assert suffix_config(512).spec().max_tokens == 512
    with pytest.raises(RequestError, match="--suffix-tokens"):
        suffix_config(0)
