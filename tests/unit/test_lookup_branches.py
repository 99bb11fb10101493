"""Lookup with several continuations: older occurrences' continuations join the tree as branches, stay lossless
(greedy equal to the target's, sampling distributed as the target's) and are learned apart by the budget."""

from __future__ import annotations

import pytest

from core_fixtures import random_prompts, tiny_target
from s2d_ray.bench.methods import parse_shape
from s2d_ray.core.acceptance import AcceptanceModel
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, add_lookup, find_continuation, find_continuations
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.tree import LOOKUP, LOOKUP_BRANCH, TokenTree
from s2d_ray.core.types import DraftRequest, SamplingParams
from test_engine_exact import run
from test_trees import repetitive_prompts, tree_engine, wrong_no_residual


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def test_continuations_most_recent_longest_first_then_older_and_shorter():
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 6, 8, 3, 7, 7, 2, 3]
    first = find_continuation(toks, 4, 6)
    got = find_continuations(toks, 4, 6, candidates=4, branch_tokens=2)
    assert got[0] == first and first.tokens == [5, 6, 8, 3, 7, 7] and first.ngram == 2
    # then the older [2, 3] (-> 4, 9), then the suffix [3] alone: after 3 at index 10 comes 7 (new), at 6 / 2 the
    # continuations [5, 6] / [4, 9] are prefixes of ones already taken and add nothing
    assert [(m.tokens, m.ngram) for m in got[1:]] == [([4, 9], 2), ([7, 7], 1)]
    assert find_continuations(toks, 4, 6, candidates=1) == [first]
    assert find_continuations([1, 2, 3], 4, 6, candidates=3) == []


def test_branches_are_marked_apart_and_merge_by_rank():
    lookup = PromptLookup(max_ngram=3, num_tokens=4, candidates=3, branch_tokens=2)
    req = DraftRequest("s", [1, 5, 1, 6, 1, 7, 7, 1], 0, SamplingParams(), tree=True)
    prop = lookup.propose([req])[0]
    # 1 -> [7, 7, 1] (most recent), then [6, 1], [5, 1]: three siblings at depth 1
    assert [t for t, p in zip(prop.tokens, prop.parents) if p == -1] == [7, 6, 5]
    assert prop.exits == [LOOKUP] * 3 + [LOOKUP_BRANCH] * 4
    tree = TokenTree()
    tree.add(-1, 6, 2, 0.4)  # a draft node the branch [6, 1] passes through
    add_lookup(tree, find_continuations(req.tokens, 3, 4, 3, 2))
    assert tree.exits[0] == LOOKUP_BRANCH and tree.scores[0] == 0.4  # valued as lookup too, the draft score kept
    tree2 = TokenTree()
    tree2.add_path([6, 1], [LOOKUP_BRANCH] * 2, [0.0] * 2)
    tree2.add_path([6, 2], [LOOKUP] * 2, [0.0] * 2)
    tree2.add_path([6, 3], [LOOKUP_BRANCH] * 2, [0.0] * 2)
    assert tree2.exits[0] == LOOKUP  # the first continuation outranks a branch, never the other way round


def test_budget_learns_branch_acceptance_apart_from_the_first_continuation():
    acc = AcceptanceModel()
    tree = TokenTree()
    tree.add_path([4, 5], [LOOKUP] * 2, [0.0] * 2)
    tree.add_path([6, 7], [LOOKUP_BRANCH] * 2, [0.0] * 2)
    before = acc.estimate(tree)
    assert before[0] > before[2]  # priors: an older occurrence is accepted less often
    for _ in range(40):
        acc.observe(tree, [2, 3])  # the branch is what the target says, every time
    after = acc.estimate(tree)
    assert after[2] > 0.8 and after[3] > 0.8 and after[0] < before[0]


def test_budget_values_lookup_nodes_by_the_suffix_length_they_matched():
    """A continuation after a 4-token match is accepted ~3x as often as after a 1-token one: the trees record the
    first match's length, the priors order them, and each length's acceptance is learned apart."""
    lookup = PromptLookup(max_ngram=4, num_tokens=3)
    long_req = DraftRequest("a", [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4], 0, SamplingParams(), tree=True)
    short_req = DraftRequest("b", [7, 5, 6, 8, 1, 2, 9, 8], 0, SamplingParams(), tree=True)
    long_prop, short_prop = lookup.propose([long_req, short_req])
    assert (long_prop.match_ngram, short_prop.match_ngram) == (4, 1)
    from s2d_ray.core.tree import proposal_tree

    long_tree, short_tree = proposal_tree(long_prop), proposal_tree(short_prop)
    assert long_tree.keep(2).match_ngram == 4 and long_tree.keep(0).match_ngram == 4  # survives the node budget
    acc = AcceptanceModel()
    assert acc.estimate(long_tree)[0] > 2.5 * acc.estimate(short_tree)[0]
    for _ in range(40):  # the short matches turn out right, every time; the long ones never
        acc.observe(short_tree, [0, 1, 2])
        acc.observe(long_tree, [])
    assert acc.estimate(short_tree)[2] > 0.8 > 0.1 > acc.estimate(long_tree)[0]
    # A tree that records no match (built by hand) keeps the old single prior, untouched by either length.
    plain = TokenTree()
    plain.add_path([4, 5], [LOOKUP] * 2, [0.0] * 2)
    assert acc.estimate(plain)[0] == pytest.approx(0.5)


def test_a_long_match_keeps_its_whole_continuation_after_4_gram_continuations_diverged():
    """A match of 8+ tokens (a repeated answer in the store of earlier outputs) is valued apart from 4-gram matches:
    after rounds in which 4-gram continuations diverged past their second token, a batch of 8 rows with a 16-token
    long match each still verifies most of it. Valued with the 4-grams, the long matches got the same 2 nodes (served
    at 8 requests, a repeat verified 4 of its 16 store nodes a round and accepted every one)."""
    from s2d_ray.core.budget import SpeculationBudget, TreeShape
    from s2d_ray.core.costs import CostModel

    costs = CostModel({1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 13.0, 16: 20.0, 32: 36.0},
                       8: {1: 14.0, 2: 17.0, 4: 22.0, 8: 32.0, 16: 52.0, 32: 95.0}}, [1.0, 1.5, 2.0])
    budget = SpeculationBudget(TreeShape(width=1, lookup=True, max_nodes=24), costs, max_depth=6)

    def chain(ngram: int) -> TokenTree:
        tree = TokenTree()
        tree.add_path(list(range(16)), [LOOKUP] * 16, [0.0] * 16)
        tree.match_ngram = ngram
        return tree

    for _ in range(40):
        budget.observe(chain(4), [0, 1])
    four = budget.node_cap([budget.acceptance.estimate(chain(4))] * 8)
    long = budget.node_cap([budget.acceptance.estimate(chain(8))] * 8)
    assert four <= 2 and long >= 12, (four, long)


def test_engine_observes_trees_with_their_match_length(target):
    """The engine's shape and verify steps carry the match length through to what the budget learns from."""
    engine = lookup_engine(target, candidates=1)
    seen = []
    observe = engine.budget.observe

    def spy(tree, path):
        if tree is not None and len(tree):
            seen.append(tree.match_ngram)
        return observe(tree, path)

    engine.budget.observe = spy
    run(engine, repetitive_prompts(2, seed=3), 24, True)
    assert seen and all(n >= 1 for n in seen) and max(seen) >= 2, seen


def lookup_engine(target, candidates: int, draft: bool = False) -> SpecEngine:
    return tree_engine(target, 3 if draft else 1, True, lookup_candidates=candidates, draft=draft)


def accepted_branch_nodes(engine: SpecEngine) -> list[int]:
    """Spy on the budget: how many accepted nodes were lookup branches (so the test proves branches are reached)."""
    seen = [0]
    observe = engine.budget.observe

    def spy(tree, path):
        if tree is not None:
            seen[0] += sum(tree.exits[i] == LOOKUP_BRANCH for i in path)
        return observe(tree, path)

    engine.budget.observe = spy
    return seen


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("batch", [False, True])
def test_greedy_with_lookup_branches_equals_target_greedy(target, draft, batch):
    prompts = repetitive_prompts(4, seed=31) + random_prompts(3, seed=31)
    ar = run(SpecEngine(TargetVerifier(target)), prompts, 48, batch=True)
    engine = lookup_engine(target, candidates=4, draft=draft)
    branches = accepted_branch_nodes(engine)
    out = run(engine, prompts, 48, batch)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert branches[0] > 0  # an older occurrence's continuation was accepted, not only proposed
    assert all("-1" not in o.metrics["accepted_exit_histogram"] for o in out)  # branches count as lookup (0)


def branch_sampling_tv(n: int) -> tuple[float, float, int]:
    """TV of output tokens 1-2 (joint, and token 1 alone) from the target's, and accepted branch nodes: the prompt's
    round verifies three lookup siblings at depth 1 (after 3 came 7, 6 and 5) and their children."""
    from test_sampling import exact_two_token_distribution, tv

    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    prompt = [3, 5, 3, 6, 3, 7, 3]
    exact = exact_two_token_distribution(target, prompt, SamplingParams(temperature=1.0))
    engine = lookup_engine(target, candidates=3)
    branches = accepted_branch_nodes(engine)
    counts = exact * 0
    for res in engine.generate([GenerationRequest(f"s{i}", prompt, 2, SamplingParams(1.0, seed=i)) for i in range(n)]):
        counts[res.token_ids[0], res.token_ids[1]] += 1
    counts /= n
    return tv(counts, exact), tv(counts.sum(1), exact.sum(1)), branches[0]


def test_sampling_with_lookup_branches_follows_the_target(monkeypatch):
    """Every candidate is a point mass and a rejected sibling leaves the residual: tokens 1-2 ~ the target's joint
    (8000 samples: 0.034 joint, 0.009 token 1); the control without that rule is caught (0.18)."""
    joint, first, branches = branch_sampling_tv(8000)
    assert branches > 100 and joint < 0.06 and first < 0.03, (joint, first, branches)
    import s2d_ray.core.engine as engine_module

    monkeypatch.setattr(engine_module, "accept_tree", wrong_no_residual)  # a rejected sibling stays in r
    _, wrong, _ = branch_sampling_tv(2000)
    assert wrong > 0.1, wrong


def test_lookup_candidates_come_from_flags_profiles_yaml_and_bench_names():
    """`spec.lookup_candidates` reaches the lookup drafter; a calibration profile sets it unless the user did (flag
    or YAML field); bench rows name it `lc<N>` / `lb<N>`, for `s2d:` and `lookup:` rows alike."""
    import argparse

    from s2d_ray.build import effective_spec, make_speculation
    from s2d_ray.commands.engine_args import add_engine_args, spec_config
    from s2d_ray.config import EngineConfig, SpecConfig

    drafter, _ = make_speculation(SpecConfig(mode="lookup", lookup_candidates=4, lookup_branch_tokens=2), None, None)
    assert (drafter.lookup.candidates, drafter.lookup.branch_tokens, drafter.draft) == (4, 2, None)
    assert effective_spec(EngineConfig(), {"lookup_candidates": 3}).lookup_candidates == 3
    assert effective_spec(EngineConfig(spec=SpecConfig(lookup_candidates=1)), {"lookup_candidates": 3}) \
        .lookup_candidates == 1
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert spec_config(parser.parse_args(["--lookup-candidates", "5"]), "s2d").lookup_candidates == 5
    assert "lookup_candidates" not in spec_config(parser.parse_args([]), "s2d").model_fields_set
    assert parse_shape("lookup+lc4+lb2") == {"lookup": True, "lookup_candidates": 4, "lookup_branch_tokens": 2}
    with pytest.raises(ValueError):
        SpecConfig(lookup_candidates=0)
