"""Token trees and lookup candidates stay lossless: tree attention, KV compaction, greedy equality, exact sampling."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from s2d_ray.core.budget import RoundPlan, SpeculationBudget, TreeShape
from s2d_ray.core.round_costs import RoundObservation
from s2d_ray.core.costs import CostModel
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.exploration import Exploration
from s2d_ray.core.lookup import PromptLookup, TreeDrafter, find_continuation
from s2d_ray.core.policy import FixedK
from s2d_ray.core.sampling import logits_to_probs, sample
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.tree import LOOKUP, TokenTree, accept_tree, ancestor_mask
from s2d_ray.core.types import SamplingParams, ScoreRequest
from test_engine_exact import reference_greedy, run


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def random_tree(n: int, vocab: int, gen: torch.Generator) -> TokenTree:
    tree = TokenTree()
    while len(tree) < n:
        parent = int(torch.randint(-1, len(tree), (1,), generator=gen))
        tree.add(parent, int(torch.randint(3, vocab, (1,), generator=gen)), 1, 0.5)
    return tree


def test_tree_verification_equals_each_path_scored_as_a_chain(target):
    """Every node sees exactly the prefix and its ancestors: its logits equal a plain forward over prefix + path."""
    gen = torch.Generator().manual_seed(0)
    verifier = TargetVerifier(target, kernels=KERNELS)
    prompts = random_prompts(3, seed=3)
    trees = [random_tree(9, 96, gen) for _ in prompts]
    reqs = [ScoreRequest(f"s{i}", p + t.tokens, len(t) + 1, t.parents) for i, (p, t) in enumerate(zip(prompts, trees))]
    # Warm one row's cache with part of its prefix so cached and uncached prefix positions mix in one batch.
    verifier.score([ScoreRequest("s0", prompts[0][:-1], 1)])
    out = verifier.score(reqs)
    with torch.no_grad():
        for p, t, logits in zip(prompts, trees, out):
            assert torch.allclose(logits[0], target(torch.tensor([p])).logits[0, -1], atol=1e-9)
            for i in range(len(t)):
                path, j = [], i
                while j >= 0:
                    path.append(t.tokens[j])
                    j = t.parents[j]
                ref = target(torch.tensor([p + path[::-1]])).logits[0, -1]
                assert torch.allclose(logits[i + 1], ref, atol=1e-9), i


def test_ancestor_mask_is_exactly_self_and_ancestors():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        tree = random_tree(12, 50, gen)
        mask = ancestor_mask(tree.parents)
        for i in range(len(tree)):
            anc, j = {i}, tree.parents[i]
            while j >= 0:
                anc.add(j)
                j = tree.parents[j]
            assert {j for j in range(len(tree)) if mask[i, j]} == anc


def test_accepted_path_kv_is_compacted(target):
    """After a tree round that accepts a sibling path, the next round's logits equal a fresh computation."""
    verifier = TargetVerifier(target, kernels=KERNELS)
    prompt = random_prompts(1, seed=4)[0]
    tree = TokenTree()
    tree.add_path([10, 11, 12], [1, 1, 1], [0.9, 0.8, 0.7])  # nodes 0-2: the spine
    sib = tree.add(-1, 20, 1, 0.1)  # node 3
    tree.add_path([21, 22], [LOOKUP] * 2, [0.0, 0.0], parent=sib)  # nodes 4-5 below the sibling
    verifier.score([ScoreRequest("s", prompt + tree.tokens, len(tree) + 1, tree.parents)])
    committed = prompt + [20, 21, 22, 30]  # accepted the sibling branch, then a bonus token
    logits = verifier.score([ScoreRequest("s", committed, 1)])[0]
    st = verifier.table.states["s"]
    assert st.filled[0] == len(committed)
    with torch.no_grad():
        assert torch.allclose(logits[0], target(torch.tensor([committed])).logits[0, -1], atol=1e-9)


def test_tree_keep_is_ancestor_closed_and_depth_capped():
    gen = torch.Generator().manual_seed(2)
    for _ in range(30):
        tree = random_tree(15, 40, gen)
        tree.scores = torch.rand(len(tree), generator=gen).tolist()
        for budget in (0, 1, 4, 9, 20):
            kept = tree.keep(budget, max_depth=3)
            assert len(kept) <= budget and all(d <= 3 for d in kept.depths())
            assert all(p < i for i, p in enumerate(kept.parents))


def test_lookup_finds_the_latest_longest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    m = find_continuation(toks, max_ngram=3, num_tokens=4)
    assert m.ngram == 3 and m.tokens == [7, 8, 5, 1]
    assert find_continuation([1, 2, 3], 3, 4).tokens == []


def tree_engine(target, width: int, lookup: bool, costs: CostModel | None = None, k: int = 3,
                lookup_candidates: int = 1, draft: bool = True) -> SpecEngine:
    """A noisy draft's width-`width` tree (no draft: lookup alone) plus `lookup_candidates` lookup continuations."""
    finder = PromptLookup(max_ngram=3, num_tokens=6, candidates=lookup_candidates) if lookup else None
    drafter = TreeDrafter(SortedDrafter(noisy_draft(target)) if draft else None, finder, alone_ngram=3)
    budget = SpeculationBudget(TreeShape(width=width, lookup=lookup, max_nodes=12), costs, max_depth=6)
    return SpecEngine(TargetVerifier(target, kernels=KERNELS), drafter, FixedK(k), budget=budget)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so lookup finds matches (as in code or math text)."""
    out = []
    for p in random_prompts(n, seed=seed, lo=4, hi=9):
        out.append(p + p + p[:2])
    return out


@pytest.mark.parametrize("width,lookup", [(2, False), (4, False), (1, True), (3, True)])
@pytest.mark.parametrize("batch", [False, True])
def test_greedy_trees_equal_target_greedy(target, width, lookup, batch):
    prompts = random_prompts(4, seed=width) + repetitive_prompts(2, seed=width)
    ar = run(SpecEngine(TargetVerifier(target, kernels=KERNELS)), prompts, 40, batch=True)
    out = run(tree_engine(target, width, lookup), prompts, 40, batch)
    accepted = drafted = 0
    for a, s in zip(ar, out):
        assert s.token_ids == a.token_ids
        accepted += s.metrics["num_accepted_draft_tokens"]
        drafted += s.metrics["num_draft_tokens"]
    assert 0 < accepted < drafted


def test_a_round_that_fills_a_prompt_does_not_draft_for_it(target):
    """TTFT: a new row's first round verifies its prompt with lookup candidates only (the draft forward waits for its
    next round, which fills the draft's prompt); a row already decoding beside it drafts as before; greedy output is
    the target's."""
    prompts = random_prompts(1, seed=21) + repetitive_prompts(1, seed=21)
    ref = [reference_greedy(target, p, 20) for p in prompts]
    engine = tree_engine(target, 3, True)
    asked: list[set[str]] = []
    draft = engine.drafter.draft
    propose = draft.propose
    draft.propose = lambda reqs: (asked.append({r.seq_id for r in reqs}), propose(reqs))[1]
    got = {"a": [], "b": []}
    engine.add_request(GenerationRequest("a", prompts[0], 20))
    for o in engine.step():
        got[o.seq_id] += o.new_tokens
    assert asked == []  # a's prompt round: no draft forward
    engine.add_request(GenerationRequest("b", prompts[1], 20))
    for o in engine.step():
        got[o.seq_id] += o.new_tokens
    assert asked == [{"a"}]  # b fills its prompt; a (decoding) drafts
    while engine.has_unfinished:
        for o in engine.step():
            got[o.seq_id] += o.new_tokens
    assert got == {"a": ref[0], "b": ref[1]}
    assert any("b" in a for a in asked)  # b drafts once its prompt is in


def test_trees_accept_siblings_and_lookup(target):
    """The fixture must exercise non-spine paths, or the compaction and tree tests prove little."""
    prompts = repetitive_prompts(4, seed=9) + random_prompts(4, seed=9)
    engine = tree_engine(target, 4, True)
    seen_off_spine = seen_lookup = 0
    original = engine.commit

    def spy(live, proposals, logits, timing):
        nonlocal seen_off_spine, seen_lookup
        outs = original(live, proposals, logits, timing)
        for prop, out in zip(proposals, outs):
            spine = [t for t, p, e in zip(prop.tokens, prop.parents or [], prop.exits) if e != LOOKUP][:1]
            if out.new_tokens and spine and out.new_tokens[0] != spine[0] and out.new_tokens[0] in prop.tokens:
                seen_off_spine += 1
        return outs

    engine.commit = spy
    res = engine.generate([GenerationRequest(f"s{i}", p, 40) for i, p in enumerate(prompts)])
    seen_lookup = sum(r.metrics["accepted_exit_histogram"].get(str(LOOKUP), 0) for r in res)
    assert seen_off_spine > 0 and seen_lookup > 0


def test_mixed_batch_of_trees_and_plain_rows(target):
    """Load-aware sizing gives some rows no nodes; chains, trees and plain steps share forwards losslessly."""
    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 13.0, 16: 20.0, 32: 36.0}}, [1.0, 1.5, 2.0])
    prompts = random_prompts(6, seed=21, lo=2, hi=30) + repetitive_prompts(2, seed=21)
    ar = run(SpecEngine(TargetVerifier(target, kernels=KERNELS)), prompts, 30, batch=True)
    out = run(tree_engine(target, 3, True, costs), prompts, 30, batch=True)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]


def test_load_aware_budget_turns_speculation_off_when_verification_is_dear(target):
    """With verification cost growing steeply in positions, the budget picks plain decoding; output unchanged."""
    dear = CostModel({1: {1: 10.0, 2: 40.0, 4: 80.0, 8: 160.0}}, [5.0, 6.0, 7.0])
    engine = tree_engine(target, 4, False, dear)
    prompts = random_prompts(3, seed=5)
    ar = run(SpecEngine(TargetVerifier(target, kernels=KERNELS)), prompts, 20, batch=True)
    out = run(engine, prompts, 20, batch=True)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert all(o.metrics["num_draft_tokens"] == 0 for o in out)
    assert engine.budget.plan(1, 0).depth == 0
    cheap = CostModel({1: {1: 10.0, 2: 10.1, 4: 10.2, 8: 10.4, 16: 10.8, 32: 12.0}}, [0.5, 0.6, 0.7])
    budget = tree_engine(target, 4, False, cheap).budget
    assert budget.plan(1, 0).depth > 0 and budget.node_cap([[0.9, 0.5, 0.3, 0.1]]) >= 2
    # The same cheap costs, but a batch so large that B * n is far beyond the measured flat region.
    assert budget.plan(512, 0).depth == 0 and budget.node_cap([[0.3, 0.2]] * 512) == 0


def test_auto_policy_stops_deepening_at_low_confidence(target):
    """Dynamic depth: with a high path-probability floor the spine stops early; output still exact."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0, 16: 12.0, 32: 14.0}}, [1.0, 1.5, 2.0])
    engine = tree_engine(target, 2, True, costs)
    prompts = random_prompts(4, seed=17) + repetitive_prompts(2, seed=17)
    ar = run(SpecEngine(TargetVerifier(target, kernels=KERNELS)), prompts, 30, batch=True)
    plans = []
    plan = engine.budget.plan
    engine.budget.plan = lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1]
    out = run(engine, prompts, 30, batch=True)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    drafting = [p for p in plans if p.depth > 0]
    assert drafting and all(p.min_score > 0 for p in drafting)
    from s2d_ray.core.types import DraftRequest

    draft = SortedDrafter(noisy_draft(target))
    req = dict(seq_id="x", tokens=prompts[0], k=6, tree=True, width=1)
    deep = draft.propose([DraftRequest(**req)])[0]
    shallow = SortedDrafter(noisy_draft(target)).propose([DraftRequest(**req, min_score=0.999)])[0]
    assert len(deep.tokens) == 6 and len(shallow.tokens) < 6


# --- sampling: exact multi-candidate acceptance ----------------------------------------------------------------
def wrong_no_residual(tree, logits, params, generator):
    """Negative control: a rejected candidate stays in r (residual not updated)."""
    kids = [i for i, p in enumerate(tree.parents) if p == -1]
    r = logits_to_probs(logits[0], params).double()
    for c in kids:
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < float(r[tree.tokens[c]]):
            return [c], 0
    return [], sample(r, generator)


def first_token_histogram(rule, tree, logits, params, n, vocab) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.float64)
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        path, nxt = rule(tree, logits, params, gen)
        counts[tree.tokens[path[0]] if path else nxt] += 1
    return counts / n


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.2, top_p=0.8)])
def test_tree_sampling_follows_target_and_converges(params):
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 1.5
    tree = TokenTree()
    for tok in (2, 0, 5):  # three deterministic candidates at depth 1
        tree.add(-1, tok, 1, 0.5)
    exact = logits_to_probs(logits[0], params)
    small = (first_token_histogram(accept_tree, tree, logits, params, 500, vocab) - exact).abs().sum() / 2
    large = (first_token_histogram(accept_tree, tree, logits, params, 8000, vocab) - exact).abs().sum() / 2
    assert large < 0.03 and large < small + 0.01


def test_wrong_sibling_rule_fails_the_same_check():
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 1.5
    tree = TokenTree()
    for tok in (2, 0, 5):
        tree.add(-1, tok, 1, 0.5)
    params = SamplingParams(temperature=1.0)
    exact = logits_to_probs(logits[0], params)
    err = (first_token_histogram(wrong_no_residual, tree, logits, params, 8000, vocab) - exact).abs().sum() / 2
    assert err > 0.05


def sampling_tree_engine(target, frontier: int = 1) -> SpecEngine:
    """The sampling tests' engine: a noisy draft's width-3 tree plus lookup candidates, at most 10 nodes, with
    `frontier` nodes expanded per depth (1: the top-1 spine)."""
    draft = SortedDrafter(noisy_draft(target, noise=0.3, thresholds=[0.3, 0.3, 0.0]))
    shape = TreeShape(width=3, lookup=True, max_nodes=10, frontier=frontier)
    return SpecEngine(TargetVerifier(target, kernels=KERNELS), TreeDrafter(draft, PromptLookup(3, 4), alone_ngram=9), FixedK(2),
                      budget=SpeculationBudget(shape, None, 4))


def test_engine_tree_sampling_follows_target_distribution():
    """End to end: draft tree + lookup, batched tree verification, commit: output tokens 2-3 (the first drafting
    round's; the prompt's round verifies lookup nodes only) ~ the target's joint."""
    from test_sampling import exact_second_and_third, pair_histogram, tv

    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    prompt = [3, 5, 3, 5, 3]  # lookup proposes [5, 3, ...]
    params = SamplingParams(temperature=1.0)
    exact = exact_second_and_third(target, prompt, params)
    err = tv(pair_histogram(sampling_tree_engine(target), 8, prompt, params, 6000)[0], exact)
    assert err < 0.06, err


def test_cached_prefix_after_every_tree_round_equals_a_fresh_forward(target):
    """Round by round: whatever path a tree round accepted, the verifier's KV of the committed prefix is exact."""
    engine = tree_engine(target, 4, True)
    prompts = repetitive_prompts(3, seed=13) + random_prompts(3, seed=13)
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(f"s{i}", p, 30))
    rounds = 0
    while engine.has_unfinished:
        engine.step()
        rounds += 1
        for seq_id, seq in engine.seqs.items():
            logits = engine.verifier.score([ScoreRequest(seq_id, seq.tokens, 1)])[0]
            with torch.no_grad():
                ref = target(torch.tensor([seq.tokens])).logits[0, -1]
            assert torch.allclose(logits[0], ref, atol=1e-9), (rounds, seq_id)
    assert rounds > 3


@pytest.mark.parametrize("lookup", [False, True])
def test_per_request_opt_out_decodes_plainly_beside_speculating_rows(target, lookup):
    """`speculate=False` (the OpenAI body's `speculate: false`): that row gets no draft and no lookup nodes, the
    others in its batch still speculate, and every output is the target's greedy."""
    prompts = repetitive_prompts(2, seed=4) + random_prompts(2, seed=4)
    reqs = [GenerationRequest(f"s{i}", p, 30, speculate=i % 2 == 0) for i, p in enumerate(prompts)]
    out = tree_engine(target, 3, lookup).generate(reqs)
    for p, o, r in zip(prompts, out, reqs):
        assert o.token_ids == reference_greedy(target, p, 30)
        assert (o.metrics["num_draft_tokens"] > 0) == r.speculate


def test_budget_prices_the_draft_against_measured_not_gridded_verification():
    """The grid says a first depth pays (1.5 x 10 ms > 10.5 ms + 4 ms of draft). Rounds that verify at half the grid's
    cost make the same draft too dear (7.5 <= 5.25 + 4): drafting stops, except the periodic exploration round;
    rounds at twice the grid's cost make it pay again. Prompt rounds (verify None) teach nothing."""
    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}}, [1.0, 2.0, 4.0])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget.rounds = 5  # not an exploration round
    assert budget.plan(1, 0).depth > 0
    for _ in range(40):
        budget.observe_round(RoundObservation(0.0065, 1, 0.004, 1, verify=(0.005, 1, 1), batch=1))
    assert budget.scale == pytest.approx(0.5, rel=1e-3) and budget.depth_seconds(1) == pytest.approx(0.004)
    budget.rounds = 5
    assert budget.plan(1, 0).depth == 0
    budget.rounds = Exploration.EVERY
    assert budget.plan(1, 0).depth > 0  # exploration keeps acceptance measured
    for _ in range(40):
        # a round untimed (a prompt, or a catch-up): neither scale nor draft cost move
        budget.observe_round(RoundObservation(0.5, 1, 9.0, 1, verify=None))
        budget.observe_round(RoundObservation(0.024, 1, 0.004, 1, verify=(0.020, 1, 1), batch=1))
    budget.rounds = 5
    assert budget.scale == pytest.approx(2.0, rel=1e-3) and budget.plan(1, 0).depth > 0


def test_budget_learns_a_draft_depth_from_warm_rounds_not_catch_ups():
    """The first drafting round after plain rounds also catches the draft up on every token since (`batch` None):
    its draft time is not a depth's cost. Learning from it prices a depth at several times its cost, and drafting never
    resumes to correct it; warm drafting rounds teach it."""
    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}}, [1.0, 2.0, 4.0])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget.rounds = 5
    for _ in range(10):  # catch-ups: 20 ms of draft time each, one depth
        budget.observe_round(RoundObservation(0.03, 2, 0.020, 1, verify=(0.010, 1, 2), batch=None))
    assert budget.depth_seconds(1) == pytest.approx(0.004)  # still the calibrated depth
    budget.rounds = 5
    assert budget.plan(1, 0).depth > 0  # 1.5 x 10 > 10.5 + 4: drafting pays
    for _ in range(40):  # warm drafting rounds at 2 ms a depth
        budget.observe_round(RoundObservation(0.013, 2, 0.002, 1, verify=(0.010, 1, 2), batch=1))
    assert budget.depth_seconds(1) == pytest.approx(0.002, rel=1e-3)
    wrong = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    wrong._depth_s = 0.020  # what counting the catch-ups learned: a depth dearer than the whole gain
    wrong.rounds = 5
    assert wrong.plan(1, 0).depth == 0


def test_budget_verifies_nodes_it_prices_out_now_and_then_so_estimates_can_recover():
    """Where width is dear (a grid where two positions cost 1.5 steps), lookup estimates that a few rejections pushed
    below the pay line would keep nodes out for good: unverified nodes teach nothing. So every 16th round
    that offers nodes and keeps none verifies them all, the gap doubling (16, 32, 64, ...) while the model still keeps
    none, and back to 16 once it keeps some."""
    costs = CostModel({1: {1: 66.0, 2: 102.0, 4: 112.0, 8: 125.0, 16: 159.0}}, [6.0, 10.0, 13.0])
    budget = SpeculationBudget(TreeShape(width=1, lookup=True, max_nodes=16), costs, max_depth=4)
    low = [[0.1, 0.05, 0.02]]  # priced out: (1 + 0.17) steps of tokens for 1.7 steps of verification
    calls = [budget.node_cap(low) for _ in range(16 + 32 + 64)]
    assert [i for i, n in enumerate(calls) if n] == [15, 47, 111] and max(calls) == 3
    assert all(budget.node_cap([[]]) == 0 for _ in range(40))  # rounds that offer nothing do not count
    assert budget.node_cap([[0.9, 0.8, 0.7, 0.6]]) == 4  # the model keeps nodes: the gap resets
    assert [budget.node_cap(low) for _ in range(16)].index(3) == 15


def test_an_engine_whose_lookup_estimates_fell_still_verifies_lookup_sometimes_and_stays_exact(target):
    """The engine with the dear grid and lookup estimates pushed to ~0: lookup nodes are still verified in some
    rounds (and learned from), and the output equals plain decoding."""
    costs = CostModel({1: {1: 66.0, 2: 102.0, 4: 112.0, 8: 125.0, 16: 159.0}}, [6.0, 10.0, 13.0])
    engine = tree_engine(target, 1, True, costs, draft=False)
    cells = [cell for bucket in engine.budget.acceptance.lookup for cell in bucket]  # every match length, depth
    for cell in cells:
        cell[0], cell[1] = 0.0, 1000.0  # as after many rejections
    prompts = repetitive_prompts(4, seed=23)
    ar = run(SpecEngine(TargetVerifier(target, kernels=KERNELS)), prompts, 40, batch=False)
    out = run(engine, prompts, 40, batch=False)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert sum(o.metrics["num_draft_tokens"] for o in out) > 0
    assert sum(cell[1] for cell in cells) > 1000.0 * len(cells)


def test_budget_keeps_lookup_nodes_only_while_measured_rounds_say_they_pay():
    """Not drafting, the model keeps lookup nodes (grid: nodes nearly free). Once both kinds of decode round are
    timed at a batch size, the measured seconds per token decide: lookup-only tree rounds at 30 ms for 2 tokens lose to
    plain rounds at 30 ms for 4 tokens (several plain steps per call), so no nodes there; another batch size is still
    modelled; one round in 16 tries trees again; a drafting round keeps its nodes; rounds without a batch (prompt
    rounds, cold drafting rounds) teach nothing. Drafting itself stays the model's choice."""
    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}, 8: {1: 12.0, 2: 12.5, 4: 13.0, 8: 14.0}},
                      [20.0, 20.0, 20.0])  # a dear draft: the model does not draft
    budget = SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=8), costs, max_depth=4)
    budget.rounds = 5
    assert budget.plan(1, 0).depth == 0 and budget.node_cap([[0.9, 0.5]]) > 0
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        budget.observe_round(RoundObservation(0.030, 4, 0.0, 0, batch=1))
        budget.observe_round(RoundObservation(9.0, 1, 0.0, 0, batch=None, nodes=3))  # a prompt round
        budget.observe_round(RoundObservation(0.050, 1, 0.004, 2, batch=1, nodes=3))  # a drafting round
    assert budget.node_cap([[0.9, 0.5]]) > 0  # lookup-only trees not timed yet: the model keeps nodes
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        budget.observe_round(RoundObservation(0.030, 2, 0.0, 0, batch=1, nodes=2))
    budget.rounds = 5
    assert budget.plan(1, 0).depth == 0 and budget.node_cap([[0.9, 0.5]]) == 0
    assert budget.plan(8, 0).depth == 0 and budget.node_cap([[0.9, 0.5]] * 8) > 0  # 5-8 rows: modelled
    budget.rounds = Exploration.EVERY // 2
    assert budget.plan(1, 0).depth == 0 and budget.node_cap([[0.9, 0.5]]) > 0  # exploration of trees
    budget.rounds = Exploration.EVERY
    assert budget.plan(1, 0).depth > 0 and budget.node_cap([[0.9, 0.5]]) > 0  # a drafting round keeps its nodes
    measured = budget.measured()
    assert set(measured) == {"1/draft", "1/plain", "1/tree", "1/nodraft"}
    # every round is in the time account, by kind: prompt rounds and drafting rounds that caught up too
    assert {k: v[0] for k, v in budget.spent.items()} == {"plain": 3, "tree": 6, "draft": 3}
    budget.observe_round(RoundObservation(0.2, 8, 0.1, 2, batch=None))  # a drafting round whose draft caught up first
    budget.observe_round(RoundObservation(0.2, 8, 0.0, 0, batch=None, prompt=True))
    assert budget.spent["catch-up"] == [1, 0.2, 8, 0.1] and budget.spent["prompt"] == [1, 0.2, 8, 0.0]
    assert measured["1/plain"]["ms_per_token"] == pytest.approx(7.5)
    assert measured["1/draft"]["ms_per_token"] == pytest.approx(50.0)


def test_budget_lets_measured_rounds_veto_drafting_from_five_rows_only():
    """A cheap draft the model would run at every batch size. Timed at 8 rows, drafting rounds yield a token per
    9 ms and rounds without the draft per 7 ms: drafting stops there (the periodic exploration round still drafts,
    and the output is unchanged: the plan only changes what is proposed). The same rates at 1 row change nothing
    (rounds that skip the draft there are mostly lookup-alone rounds); once drafting rounds are faster at 8 rows,
    drafting comes back."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 8: dict(grid)}, [0.5, 0.5, 0.5])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget.rounds = 5
    assert budget.plan(1, 0).depth > 0 and budget.plan(8, 0).depth == 0  # 8 rows: rounds without it timed first
    for batch in (1, 8):
        for _ in range(SpeculationBudget.MEASURED_AFTER):
            budget.observe_round(RoundObservation(0.009 * batch, batch, 0.0005, 1, batch=batch))  # drafting rounds
            budget.observe_round(RoundObservation(0.007 * batch, batch, 0.0, 0, batch=batch))  # plain rounds
    budget.rounds = 5
    assert budget.plan(8, 0).depth == 0 and budget.plan(6, 0).depth == 0  # 5-8 rows share the bucket
    assert budget.plan(1, 0).depth > 0 and budget.plan(4, 0).depth > 0
    budget.rounds = Exploration.EVERY
    assert budget.plan(8, 0).depth > 0  # a re-check: the catch-up round, then the timed one
    budget.rounds += 1
    assert budget.plan(8, 0).depth > 0
    for _ in range(12):
        budget.observe_round(RoundObservation(0.005 * 8, 8, 0.0005, 1, batch=8))
    budget.rounds += 1
    assert budget.plan(8, 0).depth > 0 and 8 not in budget.exploration.gaps  # drafting won: chosen again, gap reset


def test_budget_times_rounds_without_the_draft_when_the_model_drafts_from_five_rows():
    """A cheap draft the model runs at every batch size. From 5 rows, rounds without the draft are timed first (three
    decode rounds; a prompt round drafts as modelled and is not one of them), then drafting rounds; the measured rates
    then decide. While drafting keeps winning, one round in 16 is still timed without it (so the veto can act when
    load or acceptance change); below 5 rows nothing changes. Without this a run whose first rounds drafted keeps
    drafting whatever it costs."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 8: dict(grid)}, [0.5, 0.5, 0.5])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    plans = []
    for r in range(1, 7):
        budget.rounds = r
        prompt = r == 2
        plans.append(budget.plan(8, 0, prompts=int(prompt)).depth > 0)
        if not plans[-1]:
            budget.observe_round(RoundObservation(0.056, 8, 0.0, 0, batch=8))  # timed, without the draft: 7 ms a token
    assert plans == [False, True, False, False, True, True]  # 3 timed rounds without it (the prompt round drafts)
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        budget.observe_round(RoundObservation(0.040, 8, 0.0005, 1, batch=8))  # drafting rounds: 5 ms a token, faster
    assert drafting_rounds(budget, 8, range(17, 50)) == [r for r in range(17, 50) if r % 16]
    assert drafting_rounds(budget, 2, range(17, 50)) == list(range(17, 50))
    for _ in range(12):
        budget.observe_round(RoundObservation(0.080, 8, 0.0005, 1, batch=8))  # drafting got dear: 10 ms a token
    assert drafting_rounds(budget, 8, range(50, 60)) == []  # vetoed by what was measured


def drafting_rounds(budget: SpeculationBudget, batch: int, rounds: range, prompt_rounds: set[int] = frozenset()
                    ) -> list[int]:
    """The rounds (one plan each) in which the budget drafted; `prompt_rounds` fill a prompt (one row each)."""
    out = []
    for r in rounds:
        budget.rounds = r
        if budget.plan(batch, 0, prompts=int(r in prompt_rounds)).depth > 0:
            out.append(r)
    return out


def test_budget_times_joining_sequences_catch_ups_with_drafting_rounds_from_five_rows():
    """At 8 rows, sequences come and go: a drafting round in which a new sequence's prompt is filled into the
    draft (beside warm rows) is what drafting costs as sequences join, so it is timed with drafting rounds (not for the
    cost of a depth). Warm drafting rounds alone (5 ms a token) look faster than rounds without the draft (7 ms);
    with the joining rounds' catch-ups counted (50 ms a token, one round in three) they are not, and the veto acts."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 8: dict(grid)}, [0.5, 0.5, 0.5])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        budget.observe_round(RoundObservation(0.056, 8, 0.0, 0, batch=8))  # rounds without the draft: 7 ms a token
    for _ in range(4):
        budget.observe_round(RoundObservation(0.040, 8, 0.0005, 1, verify=(0.03, 8, 2), batch=8))  # warm: 5 ms a token
        budget.observe_round(RoundObservation(0.040, 8, 0.0005, 1, verify=(0.03, 8, 2), batch=8))
        budget.observe_round(RoundObservation(0.400, 8, 0.3, 1, verify=(0.03, 8, 2), batch=8, warm=False))  # one joined
    assert budget.measured_better(8, "draft", "nodraft") is False
    assert budget.depth_seconds(8) == pytest.approx(0.0005)  # the joining catch-ups are not a depth's cost
    assert budget.spent["catch-up"][0] == 4 and budget.spent["draft"][0] == 8
    assert drafting_rounds(budget, 8, range(17, 32)) == []  # vetoed
    warm_only = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        warm_only.observe_round(RoundObservation(0.056, 8, 0.0, 0, batch=8))
        warm_only.observe_round(RoundObservation(0.040, 8, 0.0005, 1, verify=(0.03, 8, 2), batch=8))
    assert warm_only.measured_better(8, "draft", "nodraft") is True  # what timing warm rounds alone would say


def test_budget_rechecks_a_vetoed_draft_in_timed_pairs_ever_less_often():
    """From 5 rows, while measured rounds veto the draft, a re-check drafts two rounds in a row (the first catches the
    draft up and is not timed; the second is), the gap doubling from 16 rounds up to 256; below 5 rows the draft is
    explored one round in 16 as before. No re-check wastes a round: without them the vetoed bucket never drafts."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 8: dict(grid)}, [50.0, 50.0, 50.0])  # a dear draft: modelled not to pay
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    assert drafting_rounds(budget, 8, range(17, 600)) == [32, 33, 64, 65, 128, 129, 256, 257, 512, 513]
    assert drafting_rounds(budget, 2, range(17, 100)) == [32, 48, 64, 80, 96]
    assert drafting_rounds(budget, 16, range(17, 40)) == [32, 33]  # 9-16 rows: a bucket of its own


def test_budget_starts_and_ends_a_recheck_pair_on_decode_rounds_only():
    """A prompt round is never timed, so a vetoed draft's re-check pair neither starts on one (it waits for the next
    decode round) nor ends on one (its second round drafts, keeping the rows warm, and the timed round is the next
    decode round). Below 5 rows nothing changes. Without the wait the pair at 32 would have been [32, 33]."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 8: dict(grid)}, [50.0, 50.0, 50.0])  # a dear draft: modelled not to pay
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    prompts = {32, 65, 66}
    assert drafting_rounds(budget, 8, range(17, 140), prompts) == [33, 34, 64, 65, 66, 67, 128, 129]
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    assert drafting_rounds(budget, 2, range(17, 70), prompts) == [32, 48, 64]


def test_engine_prompt_rounds_reach_the_budget_as_prompt_rounds(target):
    """The round that fills a prompt is neither a decode round for the cost scale nor a timed round for the
    draft/plain choice; later rounds are (the check runs before commit gives the prompt row its first token)."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [1.0, 1.5, 2.0])
    engine = tree_engine(target, 2, True, costs)
    seen = []
    observe = engine.budget.observe_round
    engine.budget.observe_round = lambda obs: (seen.append((obs.verify, obs.batch)), observe(obs))[1]
    plans = []
    plan = engine.budget.plan
    engine.budget.plan = lambda *a, **k: (plans.append(k.get("prompts")), plan(*a, **k))[1]
    run(engine, random_prompts(1, seed=2), 6, batch=True)
    assert seen[0] == (None, None)
    assert plans[0] == 1 and set(plans[1:]) == {0}  # the plan knows which round fills a prompt
    assert any(batch == 1 for _, batch in seen[1:]) and len(seen) > 1


def test_engine_times_a_drafting_round_only_when_its_rows_drafted_the_round_before(target):
    """Warm drafting rounds: the first round a sequence drafts in (after its prompt, or after plain rounds) is not
    timed as a drafting round; the next one is."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [0.1, 0.1, 0.1])
    engine = tree_engine(target, 2, False, costs)
    engine.budget.plan = lambda batch, depth, prompts=0, rows=None: RoundPlan(2, 0.0)  # always draft
    seen = []
    observe = engine.budget.observe_round
    engine.budget.observe_round = lambda obs: (seen.append((obs.depth, obs.batch)), observe(obs))[1]
    run(engine, random_prompts(1, seed=3), 8, batch=True)
    drafting = [batch for depth, batch in seen if depth > 0]
    assert drafting[0] is None and drafting[1:] and all(b == 1 for b in drafting[1:])


def test_engine_times_a_round_where_a_sequence_joins_the_draft_but_not_as_warm(target):
    """A second sequence joins while the first drafts: its first drafting round fills its prompt into the draft. The
    round is timed (`batch` 2) but not warm (not a depth's cost); a round where every drafting row is new (the first
    one) or resumes after a pause is not timed at all."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [0.1, 0.1, 0.1])
    engine = tree_engine(target, 2, False, costs)
    engine.budget.plan = lambda batch, depth, prompts=0, rows=None: RoundPlan(2, 0.0)  # always draft
    seen = []
    observe = engine.budget.observe_round
    engine.budget.observe_round = lambda obs: (seen.append((obs.depth > 0, obs.batch, obs.warm, obs.prompt)),
                                               observe(obs))[1]
    first, second = random_prompts(2, seed=4)
    engine.add_request(GenerationRequest("a", first, 30))
    for _ in range(4):
        engine.step()
    engine.add_request(GenerationRequest("b", second, 30))
    for _ in range(3):
        engine.step()
    drafting = [(batch, warm) for drafted, batch, warm, prompt in seen if drafted and not prompt]
    # a's prompt round, a's first draft (untimed), warm rounds of a; b's prompt round; b joins; warm rounds of both
    assert drafting[0] == (None, False) and set(drafting[1:3]) == {(1, True)}
    assert drafting[3:] == [(2, False), (2, True)], seen


def test_budget_drafts_a_row_only_where_its_catch_up_pays():
    """At 4 rows the model drafts (1.5 x 20 ms > 22 + 1). A row the draft must first catch up on 300 tokens (1 ms each)
    with 10 tokens left gains ~12 ms from drafting: it is held out (lookup and plain for it); a warm row (3 tokens
    behind) and a row with 2,000 tokens left draft. When every row that may draft is held, the round does not draft.
    Without `rows` every row drafts."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 4: {1: 20.0, 2: 22.0, 4: 24.0, 8: 30.0}}, [1.0, 1.0, 1.0])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget._fill_s = 0.001
    budget.rounds = 5  # not an exploration round
    assert budget.plan(4, 0).depth > 0 and budget.plan(4, 0).hold == frozenset()
    plan = budget.plan(4, 0, rows=[(300, 10), (3, 10), (300, 2000), None])
    assert plan.depth > 0 and plan.hold == {0}
    assert budget.plan(4, 0, rows=[(300, 10), None, (250, 5), None]).depth == 0
    assert budget._drafting is False  # node_cap prices the round as one without the draft
    budget._fill_s = 0.00001  # a cheap catch-up (a GPU's draft): the same rows draft
    assert budget.plan(4, 0, rows=[(300, 10), None, (250, 5), None]) == RoundPlan(4, plan.min_score)


def test_budget_explores_the_draft_only_with_cheap_catch_ups():
    """Below 5 rows a draft modelled not to pay is still explored one round in 16 (acceptance changes), but such a
    round may spend at most a row's share of one plain step (5 ms here, two rows) catching a row up: 10 tokens at 0.5 ms
    do, 100 do not."""
    grid = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    costs = CostModel({1: dict(grid), 2: dict(grid)}, [50.0, 50.0, 50.0])  # a dear draft: modelled not to pay
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget._fill_s = 0.0005
    budget.rounds = Exploration.EVERY
    assert budget.plan(2, 0, rows=[(10, 1000), None]).depth > 0
    assert budget.plan(2, 0, rows=[(100, 1000), None]).depth == 0
    budget.rounds = 5
    assert budget.plan(2, 0, rows=[(1, 1000), None]).depth == 0  # not an exploration round: the model says no


def test_budget_learns_the_draft_fill_cost_from_catch_ups():
    """A catch-up's draft time beyond its depths, over the tokens it filled, is what a filled token costs (here 1 ms:
    0.2 s for 200 tokens after one 4 ms depth); rounds that filled fewer than 16 tokens, and prompt rounds, teach
    nothing. Before any, the prior scales the target's widest calibrated forward by the draft's share of a step."""
    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 16.0}}, [1.0, 2.0, 4.0])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    assert budget.fill_seconds() == pytest.approx(4.0 / 10.0 * 16.0 / 8 / 1000)
    budget.observe_round(RoundObservation(0.5, 2, 0.9, 1, verify=None, prompt=True, warm=False, filled=400))
    budget.observe_round(RoundObservation(0.05, 2, 0.03, 1, verify=(0.01, 1, 2), warm=False, filled=8))
    assert budget._fill_s is None
    budget.observe_round(RoundObservation(0.25, 2, 0.204, 1, verify=(0.01, 1, 2), warm=False, filled=200))
    assert budget.fill_seconds() == pytest.approx(0.001)


def test_budget_forgets_sequences_that_finish_or_abort(target):
    """The budget keeps what the draft has seen of each live sequence (to price its catch-up and time its rounds); a
    sequence that finishes or is aborted leaves nothing behind, so an id used again starts from nothing."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [0.1, 0.1, 0.1])
    engine = tree_engine(target, 2, False, costs)
    engine.budget.plan = lambda batch, depth, prompts=0, rows=None: RoundPlan(2, 0.0)  # always draft
    first, second = random_prompts(2, seed=8)
    engine.add_request(GenerationRequest("a", first, 12))
    engine.add_request(GenerationRequest("b", second, 40))
    for _ in range(3):
        engine.step()
    length = len(engine.seqs["b"].tokens)
    assert engine.budget.behind("b", length) < length  # the draft has seen b
    engine.abort("b")
    assert engine.budget.behind("b", length) == length
    while engine.has_unfinished:
        engine.step()
    assert engine.budget.behind("a", 50) == 50


def test_engine_reports_what_a_resumed_draft_caught_up_on_and_holds_rows_it_prices_out(target):
    """The engine tells the budget each row's lag (tokens since the draft last saw it) and remaining tokens: after
    three rounds without the draft, the resumed round filled exactly the tokens those rounds emitted. With a fill cost
    no gain pays for, the draft never runs beside another row and the output is still the target's greedy output."""
    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [0.1, 0.1, 0.1])
    engine = tree_engine(target, 2, False, costs)
    calls = []
    engine.budget.plan = lambda batch, depth, prompts=0, rows=None: (
        calls.append(rows), RoundPlan(0 if len(calls) in (3, 4, 5) else 2, 0.0))[1]
    seen = []
    observe = engine.budget.observe_round
    engine.budget.observe_round = lambda obs: (seen.append((obs.tokens, obs.depth, obs.filled)), observe(obs))[1]
    prompt = random_prompts(1, seed=5)[0]
    engine.generate([GenerationRequest("a", prompt, 30)])
    assert calls[0] == [None] and calls[1] == [(len(prompt) + 1, 28)]  # the prompt round; the first draft's lag
    emitted = [n for n, _, _ in seen]
    assert seen[1][1] > 0 and seen[1][2] == len(prompt) + 1  # the first drafting round filled the prompt
    assert [f for _, _, f in seen[2:5]] == [0, 0, 0]
    assert seen[5][1] > 0 and seen[5][2] == sum(emitted[1:5]) and calls[5][0][0] == seen[5][2]
    assert seen[6][2] == 0  # warm again

    priced_out = tree_engine(target, 2, False, costs)
    priced_out.budget._fill_s = 10.0  # seconds a token: nothing pays it
    drafted = []  # live rows whenever the draft ran
    propose = priced_out.drafter.draft.propose
    priced_out.drafter.draft.propose = lambda reqs: (drafted.append(len(priced_out.seqs)), propose(reqs))[1]
    prompts = random_prompts(3, seed=6)
    out = run(priced_out, prompts, 20, batch=True)
    assert set(drafted) <= {1}  # never while two or more rows ran (one row: `CATCH_UP_FROM`)
    for p, res in zip(prompts, out):
        assert res.token_ids == reference_greedy(target, p, 20)


def test_budget_values_a_catch_up_by_measured_plain_and_drafting_rounds_once_both_are_timed():
    """The first depth's modelled saving undervalues drafting where deeper depths and lookup merges carry the gain
    (here drafting rounds take 69 ms a token against plain rounds' 87, where the model sees ~0 saving): a long prompt's
    catch-up (300 tokens at 1 ms) is held out on the model's figure, and drafts once measured rounds say each of its 60
    remaining tokens saves 18 ms. Lookup-alone rounds (fast only because their match was long) do not count. At one
    row nothing is held (`CATCH_UP_FROM`)."""
    grid = {1: 10.0, 2: 13.5, 4: 15.0, 8: 16.0}
    costs = CostModel({1: dict(grid), 2: dict(grid)}, [0.5, 0.5, 0.5])
    budget = SpeculationBudget(TreeShape(width=3, max_nodes=8), costs, max_depth=4)
    budget._fill_s = 0.001
    budget.rounds = 5
    held = [(300, 60), None]
    assert budget.plan(2, 0, rows=held).depth == 0  # modelled: (1.5 x 10 - 13.5 - 0.5) / 3 ms a token
    assert budget.plan(1, 0, rows=[(300, 60)]).depth > 0  # one row: not priced
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        budget.observe_round(RoundObservation(0.060, 2, 0.0, 0, nodes=4, batch=2))  # lookup-alone: 30 ms a token
        budget.observe_round(RoundObservation(0.696, 8, 0.0, 0, batch=2))  # plain, four steps a call: 87 ms a token
    assert budget.plan(2, 0, rows=held).depth == 0  # drafting not timed yet
    for _ in range(SpeculationBudget.MEASURED_AFTER):
        # drafting: 69 ms a token
        budget.observe_round(RoundObservation(0.276, 4, 0.0005, 1, verify=(0.0135, 2, 2), batch=2))
    assert budget.plan(2, 0, rows=held).depth > 0
    assert budget.plan(2, 0, rows=[(300, 10), None]).depth == 0  # 10 x 18 ms < 300 ms
