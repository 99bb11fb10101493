"""Draft-side frontier expansion (EAGLE-2 dynamic trees) stays lossless: tree attention in the draft, per-node exits
with lazy fill, KV compaction of the accepted path, greedy equality and exact sampling."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core import frontier as frontier_mod
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.cache import causal_allowed
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.frontier import DraftTree, tree_grid
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK
from s2d_ray.core.rows import PendingTree
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, SamplingParams
from test_engine_exact import reference_greedy, run
from test_trees import repetitive_prompts, sampling_tree_engine

MIXED = [0.07, 0.09, 0.0]  # thresholds that send the fixture's nodes to every exit (lazy fill happens)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def frontier_engine(target, width: int, frontier: int, lookup: bool = False, k: int = 4,
                    thresholds: list[float] | None = None) -> SpecEngine:
    draft = SortedDrafter(noisy_draft(target, thresholds=thresholds))
    drafter = TreeDrafter(draft, PromptLookup(max_ngram=3, num_tokens=6) if lookup else None, alone_ngram=3)
    shape = TreeShape(width=width, lookup=lookup, max_nodes=16, frontier=frontier)
    return SpecEngine(TargetVerifier(target), drafter, FixedK(k), budget=SpeculationBudget(shape, None, max_depth=6))


def off_spine_depth(parents: list[int], path: list[int]) -> bool:
    """Whether an accepted path goes below a node that is not its parent's first child (the top-1 spine never does)."""
    first = {}
    for i, p in enumerate(parents):
        first.setdefault(p, i)
    return len(path) >= 2 and any(first[parents[n]] != n for n in path[:-1])


# --- greedy equality -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width,frontier,lookup,thresholds", [(2, 2, False, None), (3, 3, False, MIXED),
                                                              (4, 2, True, MIXED), (2, 4, True, None)])
@pytest.mark.parametrize("batch", [False, True])
def test_greedy_frontier_trees_equal_target_greedy(target, width, frontier, lookup, thresholds, batch):
    prompts = random_prompts(4, seed=width + frontier) + repetitive_prompts(2, seed=width)
    ar = run(SpecEngine(TargetVerifier(target)), prompts, 36, batch=True)
    engine = frontier_engine(target, width, frontier, lookup, thresholds=thresholds)
    out = run(engine, prompts, 36, batch)
    for a, s in zip(ar, out):
        assert s.token_ids == a.token_ids
    assert 0 < sum(s.metrics["num_accepted_draft_tokens"] for s in out) < sum(s.metrics["num_draft_tokens"] for s in out)


def test_frontier_paths_below_non_spine_nodes_are_proposed_and_accepted(target):
    """The point of the frontier: nodes below a non-spine node, and accepted paths through them."""
    engine = frontier_engine(target, 3, 3, thresholds=MIXED)
    prompts = random_prompts(6, seed=31)
    seen = {"below": 0, "accepted": 0}
    commit = engine.commit

    def spy(live, proposals, logits, timing):
        outs = commit(live, proposals, logits, timing)
        for prop, out in zip((p for p in proposals if p.tokens), (o for p, o in zip(proposals, outs) if p.tokens)):
            seen["below"] += any(off_spine_depth(prop.parents, [prop.parents[i], i]) for i in range(len(prop.tokens))
                                 if prop.parents[i] >= 0)
            path = PendingTree(0, prop.tokens, prop.parents).path(out.new_tokens)  # the accepted nodes
            seen["accepted"] += off_spine_depth(prop.parents, path)
        return outs

    engine.commit = spy
    res = engine.generate([GenerationRequest(f"s{i}", p, 40) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, res):
        assert r.token_ids == reference_greedy(target, p, 40)
    assert seen["below"] > 0 and seen["accepted"] > 0


def test_batched_rows_of_different_shapes_equal_each_row_alone(target):
    """One propose() call mixing chains, spines and frontier trees of different width, frontier and depth gives each
    row what it gets alone (per-row masks and padding never leak between rows)."""
    prompts = random_prompts(6, seed=8, lo=3, hi=30)
    shapes = [dict(k=3, tree=True, width=2, frontier=2), dict(k=5, tree=True, width=3, frontier=3),
              dict(k=2, tree=False), dict(k=4, tree=True, width=3, frontier=1), dict(k=1, tree=True, width=4,
              frontier=4), dict(k=6, tree=True, width=2, frontier=3, min_score=0.05)]
    reqs = [DraftRequest(f"s{i}", p, **sh) for i, (p, sh) in enumerate(zip(prompts, shapes))]
    draft = noisy_draft(target, thresholds=MIXED)
    batched = SortedDrafter(draft).propose(reqs)
    for req, got in zip(reqs, batched):
        alone = SortedDrafter(draft).propose([req])[0]
        assert got.tokens == alone.tokens and got.parents == alone.parents and got.exits == alone.exits
        if got.scores is not None:
            assert got.scores == pytest.approx(alone.scores, abs=1e-12)
    assert any(len(b.tokens) > 8 for b in batched)


# --- tree attention in the draft -------------------------------------------------------------------------------------
def random_draft_tree(n: int, start: int, gen: torch.Generator) -> DraftTree:
    tree = DraftTree(start, 0, 3)
    for _ in range(n):
        parent = int(torch.randint(-1, len(tree.nodes), (1,), generator=gen))
        tree.add(parent, int(torch.randint(3, 90, (1,), generator=gen)), 1, 0.5)
    return tree


def ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_every_draft_node_attends_exactly_to_its_ancestors_and_the_prefix():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        trees = [random_draft_tree(int(torch.randint(1, 14, (1,), generator=gen)), int(torch.randint(2, 20, (1,),
                 generator=gen)), gen) for _ in range(3)]
        firsts = [t.start - int(torch.randint(0, 4, (1,), generator=gen)) for t in trees]
        nodes = [sorted(set(torch.randint(0, len(t.nodes), (4,), generator=gen).tolist())) for t in trees]
        slots, rope, allowed, valid = tree_grid(trees, firsts, nodes, torch.device("cpu"))
        for r, (t, f, ns) in enumerate(zip(trees, firsts, nodes)):
            n_c = t.start - f
            for c in range(int(valid[r].sum())):
                seen = set(torch.nonzero(allowed[r, c]).flatten().tolist())
                if c < n_c:  # a committed position: causal over the prefix
                    assert int(slots[r, c]) == f + c == int(rope[r, c]) and seen == set(range(f + c + 1))
                else:
                    i = ns[c - n_c]
                    assert int(slots[r, c]) == t.start + i and int(rope[r, c]) == t.start - 1 + t.depths[i]
                    assert seen == set(range(t.start)) | {t.start + a for a in ancestors(t.nodes.parents, i)}
            for c in range(int(valid[r].sum()), slots.shape[1]):  # padding: past every node, sees itself only
                assert int(slots[r, c]) >= t.start + len(t.nodes)
                assert set(torch.nonzero(allowed[r, c]).flatten().tolist()) == {int(slots[r, c])}


def reference_q(draft: SortedDraft, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """Slow reference: the draft's distribution after `tokens`, every position through every layer from scratch,
    leaving at the first exit whose confidence clears its threshold."""
    stack = draft.stack
    cache = stack.new_cache()
    pos = torch.arange(len(tokens))[None]
    rows = torch.zeros(1, dtype=torch.long)
    x = stack.embed(torch.tensor([tokens]))
    with torch.no_grad():
        for seg, (ex, tau) in enumerate(zip(draft.spec.exit_layers, draft.spec.thresholds)):
            x = stack.run_segment(seg, x, rows, pos, cache)
            probs = torch.softmax(stack.logits(x[0, -1]).double(), -1)
            if seg == len(draft.spec.exit_layers) - 1 or float(probs.max()) > tau:
                return probs, ex
    raise AssertionError("unreachable")


def worst_score_error(draft: SortedDraft, prompt: list[int], req: DraftRequest) -> tuple[float, int]:
    """Largest gap between each node's score / exit and the slow reference along its path; also the node count."""
    prop = SortedDrafter(draft).propose([req])[0]
    worst = 0.0
    for i in range(len(prop.tokens)):
        path = []
        j = i
        while j >= 0:
            path.append(j)
            j = prop.parents[j]
        path.reverse()
        score, ctx = 1.0, list(prompt)
        for n in path:
            q, ex = reference_q(draft, ctx)
            score *= float(q[prop.tokens[n]])
            ctx.append(prop.tokens[n])
        assert prop.exits[i] == ex or worst > 1e-6, (i, prop.exits[i], ex)
        worst = max(worst, abs(score - prop.scores[i]) / max(score, 1e-30))
    return worst, len(prop.tokens)


def test_draft_node_scores_equal_a_from_scratch_forward_along_each_path(target):
    """Each node's path probability (and exit) equals the draft run from scratch over prefix + path: node attention
    sees exactly the prefix and its ancestors, also across exits (lazy fill of ancestors and of the prefix)."""
    draft = noisy_draft(target, thresholds=MIXED)
    prompt = random_prompts(1, seed=12, lo=9, hi=10)[0]
    req = DraftRequest("s", prompt, 4, tree=True, width=3, frontier=3)
    err, n = worst_score_error(draft, prompt, req)
    assert err < 1e-9 and n >= 20


def test_a_wrong_draft_tree_mask_fails_the_same_check(target, monkeypatch):
    """Negative control: nodes that see every earlier node (a causal mask over the tree) break the scores."""
    real = frontier_mod.tree_grid

    def causal_over_nodes(trees, firsts, nodes, device):
        slots, rope, allowed, valid = real(trees, firsts, nodes, device)
        return slots, rope, causal_allowed(slots, allowed.shape[-1]) | allowed, valid

    monkeypatch.setattr(frontier_mod, "tree_grid", causal_over_nodes)
    draft = noisy_draft(target, thresholds=MIXED)
    prompt = random_prompts(1, seed=12, lo=9, hi=10)[0]
    err, _ = worst_score_error(draft, prompt, DraftRequest("s", prompt, 4, tree=True, width=3, frontier=3))
    assert err > 1e-6


# --- KV compaction ---------------------------------------------------------------------------------------------------
def kv_gaps(drafter: SortedDrafter, seq_id: str, tokens: list[int]) -> tuple[float, list[int]]:
    """Largest gap between the drafter's KV / kept hidden states for `seq_id` and the draft recomputed from scratch
    over `tokens`, over the slots each segment says it holds; also those fills."""
    st = drafter.table.states[seq_id]
    stack = drafter.stack
    cache = stack.new_cache()
    pos = torch.arange(len(tokens))[None]
    rows = torch.zeros(1, dtype=torch.long)
    x = stack.embed(torch.tensor([tokens]))
    worst = 0.0
    with torch.no_grad():
        for seg, (lo, hi) in enumerate(stack.segments):
            x = stack.run_segment(seg, x, rows, pos, cache)
            n = st.filled[seg]
            for layer in range(lo, hi):
                for mine, ref in ((drafter.cache.keys, cache.keys), (drafter.cache.values, cache.values)):
                    worst = max(worst, float((mine[layer][st.row, :n] - ref[layer][0, :n]).abs().max()))
            if seg < len(stack.segments) - 1:
                worst = max(worst, float((drafter.hidden.bufs[seg][st.row, :n] - x[0, :n]).abs().max()))
    return worst, list(st.filled)


def off_spine_paths(prop) -> list[list[int]]:
    """Root-to-node paths of a proposal that leave the spine (what a tree round may accept), deepest first."""
    paths = []
    for i in range(len(prop.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = prop.parents[j]
        if off_spine_depth(prop.parents, path[::-1]):
            paths.append(path[::-1])
    assert paths
    return sorted(paths, key=len, reverse=True)


def mixed_fill_path(prop, tree: DraftTree) -> list[int]:
    """An off-spine path whose nodes hold KV to different depths (some left early, some were lazily filled), so
    compaction must keep per-segment fills apart; the deepest off-spine path when there is none."""
    paths = off_spine_paths(prop)
    for path in paths:
        inner = path[:-1]  # the leaf was never forwarded
        if len({tuple(seg[n] for n in inner) for seg in tree.filled}) > 1:
            return path
    return paths[0]


def compaction_gap(target, break_move: bool = False) -> tuple[float, list[int], int]:
    draft = noisy_draft(target, thresholds=MIXED)
    drafter = SortedDrafter(draft)
    if break_move:  # negative control: leave the accepted path's KV where the tree put it
        drafter.cache.move_slots = lambda row, src, dst: None
    prompt = random_prompts(1, seed=12, lo=9, hi=10)[0]
    prop = drafter.propose([DraftRequest("s", prompt, 4, tree=True, width=3, frontier=3)])[0]
    accepted = [prop.tokens[n] for n in mixed_fill_path(prop, drafter.trees["s"][1])]
    committed = prompt + accepted + [7]  # the accepted path, then a bonus token
    drafter.propose([DraftRequest("s", committed, 0, tree=True, width=3, frontier=3)])  # compacts and syncs only
    gap, filled = kv_gaps(drafter, "s", committed)
    return gap, filled, len(prompt)


def test_draft_kv_after_commit_equals_recomputing_the_accepted_path(target):
    gap, filled, prompt_len = compaction_gap(target)
    assert gap < 1e-10
    assert filled[0] > prompt_len  # the path's KV was kept (not recomputed) ...
    assert len(set(filled)) > 1  # ... and segments hold it to different depths (nodes left at different exits)


def test_a_wrong_compaction_fails_the_same_check(target):
    gap, _, _ = compaction_gap(target, break_move=True)
    assert gap > 1e-6


def test_next_round_after_commit_equals_a_fresh_drafter(target):
    """Round after round, a drafter that compacts its trees proposes what a fresh drafter proposes from scratch."""
    draft = noisy_draft(target, thresholds=MIXED)
    drafter = SortedDrafter(draft)
    tokens = random_prompts(1, seed=40, lo=9, hi=10)[0]
    for _ in range(6):
        req = DraftRequest("s", tokens, 3, tree=True, width=3, frontier=2)
        prop = drafter.propose([req])[0]
        fresh = SortedDrafter(draft).propose([req])[0]
        assert prop.tokens == fresh.tokens and prop.exits == fresh.exits
        assert prop.scores == pytest.approx(fresh.scores, abs=1e-12)
        tokens = tokens + [prop.tokens[n] for n in off_spine_paths(prop)[0]] + [5]


# --- sampling ------------------------------------------------------------------------------------------------------
def first_drafted_trees(engine: SpecEngine, prompt_len: int) -> dict:
    """Records each sequence's tree as verified (after shaping) in the round that drafts right after its first token."""
    trees, shape = {}, engine.shape_trees

    def recording(live, proposals):
        out = shape(live, proposals)
        for seq, prop in zip(live, out):
            if len(seq.tokens) == prompt_len + 1 and prop.tokens:
                trees.setdefault(seq.req.seq_id, prop)
        return out

    engine.shape_trees = recording
    return trees


def accepted_off_spine(trees: dict, results) -> int:
    """Outputs whose tokens 2-3 are an off-spine depth-2 path of that round's tree: accepted, since a rejected
    candidate's token is removed from the residual, so no other draw can emit it there."""
    hits = 0
    for res in results:
        prop = trees.get(res.seq_id)
        if prop is not None:
            pairs = [[p, n] for n, p in enumerate(prop.parents) if p >= 0 and prop.parents[p] == -1]
            hits += any(off_spine_depth(prop.parents, path) and [prop.tokens[n] for n in path] == res.token_ids[1:3]
                        for path in pairs)
    return hits


def test_frontier_tree_sampling_follows_target_distribution():
    """End to end with sampling: frontier draft tree (depth 2) + lookup, tree verification, commit: output tokens 2-3
    (the first drafting round's; the prompt's round verifies lookup nodes only) follow the target's joint
    distribution, and some of them came from depth-2 nodes below a depth-1 sibling (what only a frontier proposes)."""
    from test_sampling import exact_second_and_third, pair_histogram, tv

    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    prompt = [3, 5, 3, 5, 3]
    params = SamplingParams(temperature=1.0)
    exact = exact_second_and_third(target, prompt, params)
    engine = sampling_tree_engine(target, frontier=3)
    trees = first_drafted_trees(engine, len(prompt))
    hist, results = pair_histogram(engine, 8, prompt, params, 6000)
    err = tv(hist, exact)
    assert err < 0.06, err
    assert accepted_off_spine(trees, results) > 0  # the frontier's own nodes were accepted, so they were tested
    spine_only = sampling_tree_engine(target)  # the control: a top-1 spine's siblings are leaves: the count stays 0
    trees = first_drafted_trees(spine_only, len(prompt))
    assert accepted_off_spine(trees, pair_histogram(spine_only, 8, prompt, params, 500)[1]) == 0


def test_a_lookup_chain_merged_into_draft_nodes_keeps_its_value():
    """Frontier trees hold many draft nodes, so lookup chains often merge into them: the merged node must be valued
    as a lookup candidate too, or the lookup chain below it is cut by the draft node's low estimate."""
    from s2d_ray.core.acceptance import AcceptanceModel
    from s2d_ray.core.tree import LOOKUP, TokenTree

    tree = TokenTree()
    tree.add(-1, 5, 2, 0.03)  # a draft node the draft barely believes in
    tree.add_path([5, 6, 7], [LOOKUP] * 3, [0.0] * 3)
    model = AcceptanceModel()
    est = model.estimate(tree)
    assert len(tree) == 3 and tree.exits[0] == LOOKUP and tree.scores[0] == 0.03
    assert est[2] == pytest.approx(model._lookup_p(LOOKUP, 3))


def test_keep_breaks_ties_of_binned_estimates_by_path_probability():
    """Two nodes with the same (binned) estimate: the one the draft believes more is kept, not the first in order."""
    from s2d_ray.core.tree import TokenTree

    tree = TokenTree()
    a = tree.add(-1, 5, 1, 0.9)
    tree.add(-1, 6, 1, 0.21)  # same bin as the deeper node below, lower path probability
    tree.add(a, 7, 1, 0.29)
    kept = tree.keep(2, rank=[0.5, 0.2, 0.2])
    assert kept.tokens == [5, 7]


def test_frontier_is_configuration_from_flags_profiles_and_bench_names():
    """`spec.frontier` reaches the budget's tree shape; a calibration profile sets it unless the user did; bench rows
    name it `f<N>`."""
    from s2d_ray.bench.methods import parse_shape
    from s2d_ray.build import effective_spec, make_speculation
    from s2d_ray.config import EngineConfig, SpecConfig

    _, budget = make_speculation(SpecConfig(width=3, lookup=True, frontier=4), None, None)
    assert budget.shape.frontier == 4
    assert effective_spec(EngineConfig(), {"frontier": 3}).frontier == 3
    assert effective_spec(EngineConfig(spec=SpecConfig(frontier=2)), {"frontier": 3}).frontier == 2
    assert parse_shape("tree3+f4") == {"width": 3, "frontier": 4}


def test_an_evicted_sequence_leaves_no_pending_tree_and_recomputes_exactly(target):
    """With one row, a second sequence evicts the first: its pending tree is dropped (nothing stale is compacted into
    the new owner's row) and when the first returns it recomputes, proposing what a fresh drafter proposes."""
    draft = noisy_draft(target, thresholds=MIXED)
    drafter = SortedDrafter(draft)
    drafter.table.set_limits(1)
    a, b = random_prompts(2, seed=50, lo=8, hi=12)
    shape = dict(k=3, tree=True, width=3, frontier=2)
    prop = drafter.propose([DraftRequest("a", a, **shape)])[0]
    drafter.propose([DraftRequest("b", b, **shape)])
    assert set(drafter.trees) == {"b"}
    again = a + [prop.tokens[n] for n in off_spine_paths(prop)[0]] + [5]
    got = drafter.propose([DraftRequest("a", again, **shape)])[0]
    fresh = SortedDrafter(draft).propose([DraftRequest("a", again, **shape)])[0]
    assert got.tokens == fresh.tokens and got.scores == pytest.approx(fresh.scores, abs=1e-12)


def test_frontier_trees_with_chunked_draft_prefill_equal_target_greedy(target):
    """Long prompts fill the draft's KV in chunks (every segment) before the root step; frontier rounds after that
    (and their lazy fill of deeper segments) stay exact."""
    drafter = TreeDrafter(SortedDrafter(noisy_draft(target, thresholds=MIXED), prefill_chunk=5), None)
    shape = TreeShape(width=3, max_nodes=16, frontier=3)
    engine = SpecEngine(TargetVerifier(target), drafter, FixedK(4), budget=SpeculationBudget(shape, None, 6))
    prompts = random_prompts(4, seed=60, lo=12, hi=40)
    for p, r in zip(prompts, run(engine, prompts, 24, batch=True)):
        assert r.token_ids == reference_greedy(target, p, 24)
