"""A later request forks the KV a finished request left in the prefix cache: output equals no cache (float64)."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.prefix_cache import PrefixCacheSpec
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, SamplingParams, ScoreRequest
from test_trees import tree_engine

SYSTEM = 60  # a shared "system prompt": longer than the cache's min_tokens


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(target, kind: str, cache: PrefixCacheSpec | None) -> SpecEngine:
    if kind == "ar":
        return SpecEngine(TargetVerifier(target, prefix_cache=cache))
    if kind == "s2d":
        return SpecEngine(TargetVerifier(target, prefix_cache=cache),
                          SortedDrafter(noisy_draft(target), prefix_cache=cache), policy=FixedK(3))
    eng = tree_engine(target, width=3, lookup=True)
    eng.verifier.table.use_prefix_cache(cache)
    eng.drafter.draft.table.use_prefix_cache(cache)
    return eng


def sorted_drafter(eng: SpecEngine) -> SortedDrafter:
    return eng.drafter if isinstance(eng.drafter, SortedDrafter) else eng.drafter.draft


def requests(params: SamplingParams) -> list[GenerationRequest]:
    """A system prompt + distinct questions, then a second turn carrying the first (a chat)."""
    system = tokens(1, SYSTEM)
    first = [GenerationRequest(f"q{i}", system + tokens(10 + i, 7), 12, params, logprobs=2) for i in range(3)]
    return first + [GenerationRequest("turn2", system + tokens(10, 7) + tokens(20, 5), 12, params, logprobs=2)]


def run_one_by_one(eng: SpecEngine, reqs: list[GenerationRequest], before=None) -> list:
    out = []
    for req in reqs:
        if before is not None:
            before(eng, req)
        out.append(eng.generate([req])[0])
    return out


@pytest.mark.parametrize("kind", ["ar", "s2d", "tree"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
def test_cached_prefixes_give_the_output_of_no_cache(target, kind, params):
    cached = engine(target, kind, PrefixCacheSpec(max_tokens=4096))
    got = run_one_by_one(cached, requests(params))
    want = run_one_by_one(engine(target, kind, None), requests(params))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-12)
    stats = cached.verifier.prefix_cache_stats()
    # q1, q2 hit the system prompt; turn2 hits all of q0's prompt (and its KV'd output): the counts are tokens.
    assert stats["prefix_cache_hits"] >= 2 * SYSTEM + SYSTEM + 7
    assert stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert engine(target, kind, None).verifier.prefix_cache_stats() == {}
    if kind != "ar":  # the draft forks the same prefixes (all but the last prompt token, which it always re-runs)
        assert sorted_drafter(cached).prefix_cache_stats()["prefix_cache_hits"] >= 3 * SYSTEM


SHALLOW, DEEP = (0.0, 0.0, 0.0), (1.0, 1.0, 0.0)  # every token leaves at exit 1 / at the last exit


@pytest.mark.parametrize("first,second", [(SHALLOW, DEEP), (DEEP, SHALLOW), (DEEP, DEEP)],
                         ids=["lazy-fill-after-fork", "deep-entry-shallow-use", "deep"])
def test_a_drafter_fork_copies_kv_and_kept_exit_states(target, first, second):
    """The forked draft row holds what drafting the prompt itself computes, in every segment: a request that left
    at exit 1 leaves only the first segment in the cache, and a later one that goes deeper fills the rest lazily
    after the fork; its proposal (tokens and exits) equals the one without the cache."""
    draft = noisy_draft(target, num_layers=3, exits=[1, 2, 3], thresholds=[0.0, 0.0, 0.0])
    system = tokens(1, SYSTEM)
    cached = SortedDrafter(draft, prefix_cache=PrefixCacheSpec(max_tokens=4096))
    plain = SortedDrafter(draft)
    props = []
    for d in (cached, plain):
        d.propose([DraftRequest("a", system + [5, 6], 2, SamplingParams(), thresholds=first)])
        d.release("a")
        props.append(d.propose([DraftRequest("b", system + [7, 8, 9], 3, SamplingParams(), thresholds=second)])[0])
    st, ref = cached.table.states["b"], plain.table.states["b"]
    assert cached.prefix_cache_stats()["prefix_cache_hits"] >= SYSTEM
    assert (props[0].tokens, props[0].exits) == (props[1].tokens, props[1].exits)
    assert set(props[0].exits) == ({3} if second == DEEP else {1})
    # A deep cache entry may hold more than a shallow request computes itself; never less, and what both hold agrees.
    assert all(c >= r for c, r in zip(st.filled, ref.filled)) and st.filled[0] == ref.filled[0]
    filled = [min(c, r) for c, r in zip(st.filled, ref.filled)]
    if second == DEEP:  # the deeper segments really hold the prompt: the comparison below is not of empty rows
        assert min(filled) >= SYSTEM
    for seg, n in enumerate(filled[:-1]):
        torch.testing.assert_close(cached.hidden.bufs[seg][st.row, :n], plain.hidden.bufs[seg][ref.row, :n],
                                   rtol=0, atol=1e-12)
    for layer, (mine, other) in enumerate(zip(cached.cache.keys + cached.cache.values,
                                              plain.cache.keys + plain.cache.values)):
        n = filled[min(layer % len(cached.cache.keys), len(filled) - 1)]  # one layer per segment here
        torch.testing.assert_close(mine[st.row, :n], other[ref.row, :n], rtol=0, atol=1e-12)
        assert n == 0 or bool(mine[st.row, :n].abs().sum() > 0)  # rows of real KV, not an empty or zero region


def test_deeper_exits_accept_the_same_with_and_without_the_cache(target):
    """An engine whose draft leaves at every exit (thresholds that split tokens between exits 1-3): with the prefix
    cache, the output, the accepted-token counts and the exit histograms equal those without it. Control: the draft
    really used its deeper exits."""
    draft = noisy_draft(target, num_layers=3, exits=[1, 2, 3], thresholds=[0.6, 0.6, 0.0])
    runs = {}
    for name, cache in (("cached", PrefixCacheSpec(max_tokens=4096)), ("plain", None)):
        eng = SpecEngine(TargetVerifier(target, prefix_cache=cache), SortedDrafter(draft, prefix_cache=cache),
                         policy=FixedK(3))
        runs[name] = run_one_by_one(eng, requests(SamplingParams()))
        if cache is not None:
            assert eng.drafter.prefix_cache_stats()["prefix_cache_hits"] >= 3 * SYSTEM
    keys = ("num_accepted_draft_tokens", "num_draft_tokens", "exit_histogram", "accepted_exit_histogram")
    for got, want in zip(runs["cached"], runs["plain"]):
        assert got.token_ids == want.token_ids
        assert {k: got.metrics[k] for k in keys} == {k: want.metrics[k] for k in keys}
    exits = {e for r in runs["plain"] for e in r.metrics["exit_histogram"]}
    assert {"2", "3"} & exits and sum(r.metrics["num_accepted_draft_tokens"] for r in runs["plain"]) > 0


def test_a_cache_entry_for_another_prefix_is_caught(target):
    """Negative control: an entry whose tokens claim a prefix its KV was not computed for changes the output, so
    the equality above would catch a lookup that used the wrong entry."""
    reqs = requests(SamplingParams())
    want = run_one_by_one(engine(target, "ar", None), reqs)

    def mislabel(eng: SpecEngine, req: GenerationRequest) -> None:
        for state in eng.verifier.table.prefix_cache.states():  # claim the next prompt's tokens for this KV
            n = state.filled[0]
            state.tokens = list(req.prompt_ids[:n]) + state.tokens[n:]

    eng = engine(target, "ar", PrefixCacheSpec(max_tokens=4096))
    other = GenerationRequest("other", tokens(99, SYSTEM + 7), 12, reqs[0].params, logprobs=2)  # another prefix
    got = run_one_by_one(eng, [other] + reqs[1:], before=lambda e, r: mislabel(e, r) if r is not other else None)
    assert eng.verifier.prefix_cache_stats()["prefix_cache_hits"] >= 3 * SYSTEM
    for g, w in zip(got[1:], want[1:]):  # greedy tokens of a random model repeat a lot: its logprobs show it
        assert [lp.logprob for lp in g.logprobs] != pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-6)


def test_cached_tokens_stay_under_the_budget_and_rows_are_reused(target):
    """A soak of distinct long prompts: the cache holds at most max_tokens positions, and rows whose slots add up to
    at most max_tokens; the oldest go first."""
    spec = PrefixCacheSpec(max_tokens=600)
    verifier = TargetVerifier(target, prefix_cache=spec)
    for i in range(12):
        seq = f"s{i}"
        verifier.score([ScoreRequest(seq, tokens(100 + i, 90), 1)])
        verifier.release(seq)
        cache = verifier.table.prefix_cache
        assert cache.num_tokens <= spec.max_tokens
        assert len(cache) * verifier.cache.num_slots <= spec.max_tokens
        assert len(cache) == min(i + 1, 600 // 90, 600 // verifier.cache.num_slots)
    assert len(verifier.table.prefix_cache) >= 2
    assert verifier.cache.num_rows <= 8  # freed rows are reused, the cache does not grow per prompt
    assert verifier.prefix_cache_stats()["prefix_cache_hits"] == 0  # distinct prompts share nothing


def test_a_longer_turn_replaces_its_earlier_turn_and_short_rows_are_not_kept(target):
    verifier = TargetVerifier(target, prefix_cache=PrefixCacheSpec(max_tokens=1000))
    chat = tokens(3, 50)
    verifier.score([ScoreRequest("t1", chat, 1)])
    verifier.release("t1")
    verifier.score([ScoreRequest("t2", chat + tokens(4, 20), 1)])
    verifier.release("t2")
    cache = verifier.table.prefix_cache
    assert len(cache) == 1 and cache.num_tokens == 70  # turn 2 holds all of turn 1
    assert verifier.prefix_cache_stats()["prefix_cache_hits"] == 50
    verifier.score([ScoreRequest("short", tokens(5, 10), 1)])
    verifier.release("short")
    assert len(cache) == 1


@pytest.mark.parametrize("other", ["tenant-b:", "tenant-a|salt:", ""])
def test_a_scope_forks_only_its_own_rows_and_keeps_its_entries(target, other):
    """Seq ids `<scope>:<id>` (the server's tenant and cache_salt): another scope's cached prompt and live rows give
    no hit, and its longer turn does not drop the first scope's entry as redundant; the same scope (the negative
    control) does hit."""
    verifier = TargetVerifier(target, prefix_cache=PrefixCacheSpec(max_tokens=1000))
    chat = tokens(9, 50)
    verifier.score([ScoreRequest("tenant-a:t1", chat, 1)])
    verifier.release("tenant-a:t1")
    verifier.score([ScoreRequest(f"{other}t2", chat + tokens(10, 20), 1)])
    assert verifier.table.num_forked_tokens == 0 and verifier.prefix_cache_stats()["prefix_cache_hits"] == 0
    verifier.release(f"{other}t2")
    assert len(verifier.table.prefix_cache) == 2  # both kept: neither scope's entry covers the other's
    verifier.score([ScoreRequest("tenant-a:t3", chat + tokens(11, 5), 1)])
    assert verifier.prefix_cache_stats()["prefix_cache_hits"] == 50  # its own scope: the whole first turn


def test_the_drafter_forks_within_a_scope_only(target):
    """The shared draft's cache is scoped as the target's: another tenant's prompt gives no hit, its own does."""
    draft = noisy_draft(target, num_layers=3, exits=[1, 2, 3], thresholds=[0.0, 0.0, 0.0])
    system = tokens(1, SYSTEM)
    d = SortedDrafter(draft, prefix_cache=PrefixCacheSpec(max_tokens=4096))
    d.propose([DraftRequest("ta:a", system + [5, 6], 2, SamplingParams())])
    d.release("ta:a")
    d.propose([DraftRequest("tb:b", system + [7, 8, 9], 3, SamplingParams())])
    assert d.prefix_cache_stats()["prefix_cache_hits"] == 0
    d.propose([DraftRequest("ta:c", system + [7, 8, 9], 3, SamplingParams())])
    assert d.prefix_cache_stats()["prefix_cache_hits"] >= SYSTEM


def test_with_rows_bounded_cached_rows_give_way_before_live_ones(target):
    verifier = TargetVerifier(target, prefix_cache=PrefixCacheSpec(max_tokens=1000))
    verifier.table.set_limits(2)
    verifier.score([ScoreRequest("a", tokens(6, 40), 1)])
    verifier.release("a")
    verifier.score([ScoreRequest("b", tokens(7, 40), 1), ScoreRequest("c", tokens(8, 40), 1)])
    assert verifier.table.num_evicted == 0 and len(verifier.table.prefix_cache) == 0


def test_a_size_is_required():
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCacheSpec(max_tokens=0)


def test_bench_workloads_share_a_long_prefix_or_repeat_the_list():
    from s2d_ray.bench.serve import SHARED_SYSTEM_PROMPT, workload_prompts

    base = ["a?", "b?"]
    shared = workload_prompts("shared-prefix", base)
    assert all(p.startswith(SHARED_SYSTEM_PROMPT) and p.endswith(q) for p, q in zip(shared, base))
    assert workload_prompts("repeated", base) == base + base and workload_prompts("mixed", base) == base
    # a level of `requests` sends prompts[0:requests]: its second half repeats its first whatever the base's length
    many = [f"q{i}?" for i in range(48)]
    for requests in (4, 48, 96):
        sent = workload_prompts("repeated", many, requests)[:requests]
        half = requests // 2
        assert len(sent) == requests and sent[half:] == sent[:half] == many[:half]
    with pytest.raises(ValueError, match="workload"):
        workload_prompts("other", base)


def test_the_repeated_workload_reports_each_pass_apart_without_the_warmed_up_prompts():
    from s2d_ray.bench.serve import RequestResult, level_summary, repeat_passes
    from s2d_ray.bench.serve_report import serve_markdown

    def result(index: int, latency: float, ok: bool = True) -> RequestResult:
        return RequestResult(ok, latency, tokens=10, prompt_index=index % 6, request_index=index)

    # prompts 0-2, then again; prompt 0 was a warm-up request, so its first pass is fast (a repeat already); request
    # 7 cycles the list: prompt 1 a third time, a repeat
    results = [result(0, 0.1), result(1, 1.0), result(2, 1.0), result(3, 0.1), result(4, 0.4), result(5, 0.1),
               result(6, 9.0, ok=False), result(7, 0.5)]
    passes = repeat_passes(results, 3, skip=1)
    assert passes["first_pass_completed"] == 2 and passes["second_pass_completed"] == 3
    assert passes["first_pass_tokens_per_s_per_stream"] == 10.0 and passes["second_pass_tokens_per_s_per_stream"] == 30.0
    assert passes["second_over_first"] == 3.0
    assert repeat_passes(results, 3)["second_over_first"] < 3.0  # the warm-up prompt counted: a smaller ratio
    summary = {**level_summary(1, results, 1.0), **passes}
    run = {"url": "u", "model": "m", "concurrency": [1], "max_tokens": 8, "temperature": 0.0, "requests": 6, "max_seconds": 1.0}
    assert "| 1 | 2, 10.00 | 3, 30.00 | 3.00 |" in serve_markdown({"run": run, "summary": [summary]})


def test_the_config_requires_a_positive_size_when_enabled():
    from pydantic import ValidationError

    from s2d_ray.config import EngineConfig, PrefixCacheConfig

    assert EngineConfig().prefix_cache.spec() == PrefixCacheSpec(16384)  # on by default
    assert PrefixCacheConfig(enabled=False, max_tokens=None).spec() is None
    for bad in ({"max_tokens": None}, {"max_tokens": 0}):
        with pytest.raises(ValidationError, match="max_tokens"):
            PrefixCacheConfig(**bad)
