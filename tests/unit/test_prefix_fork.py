"""Sequences sharing a prompt prefill it once: the verifier forks the KV (float64; equal to computing it per row)."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.rows import FREE_WIDTH
from s2d_ray.core.target import TargetVerifier, fork_order
from s2d_ray.core.types import SamplingParams, ScoreRequest
from test_trees import tree_engine

PROMPT_LEN = 45  # longer than FREE_WIDTH, so rows of one new prompt wait for a second forward and fork


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def score_both(target, calls: list[list[ScoreRequest]]) -> TargetVerifier:
    """Run the same calls through a forking verifier and one that computes every row; logits must agree."""
    shared, plain = TargetVerifier(target), TargetVerifier(target, share_prefixes=False)
    for reqs in calls:
        for a, b in zip(shared.score(reqs), plain.score(reqs)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for seq_id, st in shared.table.states.items():  # the forked rows' KV is what computing it gives
        row = plain.table.states[seq_id].row
        n = st.filled[0]
        for mine, ref in zip(shared.cache.keys + shared.cache.values, plain.cache.keys + plain.cache.values):
            torch.testing.assert_close(mine[st.row, :n], ref[row, :n], rtol=0, atol=1e-12)
    return shared


def test_rows_of_one_new_prompt_prefill_it_once(target):
    p = prompt(1)
    calls = [[ScoreRequest(f"c{i}", p, 1) for i in range(3)],
             [ScoreRequest(f"c{i}", p + [5 + i, 7, 9 + i], 3) for i in range(3)]]  # different continuations after
    v = score_both(target, calls)
    assert v.table.num_forked_tokens == 2 * (PROMPT_LEN - 1)  # two rows copied the first's prompt, all but the last


def test_a_new_row_forks_a_live_rows_prefix_and_trees_are_never_copied(target):
    p, q = prompt(2), prompt(3, 10)
    calls = [[ScoreRequest("a", p + [4, 5, 6], 4, parents=[-1, 0, 0])],  # a tree after the prompt
             [ScoreRequest("b", p + q, 2)],  # a later request sharing the prompt (a system prompt)
             [ScoreRequest("c", p[:20] + q, 1), ScoreRequest("b", p + q + [8], 2)]]
    v = score_both(target, calls)
    assert v.table.num_forked_tokens == PROMPT_LEN + 20  # b: the prompt, not the tree's nodes; c: 20 positions


def test_rows_of_other_scopes_never_fork_each_other(target):
    """One new prompt from two scopes in one call: each scope computes it (no copy across), and neither waits for
    the other's forward; two rows of one scope still fork."""
    p = prompt(4)
    reqs = [ScoreRequest("x:a", p, 1), ScoreRequest("y:a", p, 1), ScoreRequest("x:b", p, 1)]
    assert fork_order(reqs, [0, 0, 0]) == [[0, 1], [2]]
    v = score_both(target, [reqs])
    assert v.table.num_forked_tokens == PROMPT_LEN - 1  # x:b from x:a only


def test_short_or_scored_prompts_are_computed_in_one_forward():
    p = prompt(4)
    same = [ScoreRequest(f"c{i}", p, 1) for i in range(2)]
    assert fork_order(same, [0, 0]) == [[0], [1]]
    assert fork_order(same, [0, 0], min_shared=PROMPT_LEN) == [[0, 1]]  # too short to pay for a second forward
    echo = [ScoreRequest(f"c{i}", p, PROMPT_LEN) for i in range(2)]  # every position's logits wanted: nothing shared
    assert fork_order(echo, [0, 0]) == [[0, 1]]
    a, b = prompt(5), prompt(6)
    mixed = [ScoreRequest("x", a, 1), ScoreRequest("y", b, 1), ScoreRequest("z", a[:FREE_WIDTH] + b, 1),
             ScoreRequest("w", b, 1)]
    assert fork_order(mixed, [0, 0, 0, 0]) == [[0, 1], [2, 3]]  # z shares x's first FREE_WIDTH tokens, w all of y's
    assert fork_order(mixed, [5, 0, 0, 0]) == [[0, 1, 2], [3]]  # x holds KV already: it is no new prompt to wait for
    short = [ScoreRequest("x", a, 1), ScoreRequest("z", a[:FREE_WIDTH - 1] + b, 1)]
    assert fork_order(short, [0, 0]) == [[0, 1]]  # one token short of FREE_WIDTH shared


@pytest.mark.parametrize("kind", ["ar", "s2d", "tree"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "seeded"])
def test_n_choices_sharing_the_prefill_equal_each_choice_alone(target, kind, params):
    """The n choices of a request (seed + i each, as the router builds them) with the prompt prefilled once equal
    the same choices each run alone, tokens and logprobs; and reruns reproduce them."""
    def engine() -> SpecEngine:
        if kind == "ar":
            return SpecEngine(TargetVerifier(target))
        if kind == "s2d":
            return SpecEngine(TargetVerifier(target), SortedDrafter(noisy_draft(target)), policy=FixedK(3))
        return tree_engine(target, width=3, lookup=True)

    p = prompt(5)

    def choice(i: int) -> GenerationRequest:
        seed = None if params.seed is None else params.seed + i
        return GenerationRequest(f"r-{i}", p, 16, SamplingParams(params.temperature, params.top_k, params.top_p,
                                                                 seed=seed), logprobs=2)

    eng = engine()
    together = eng.generate([choice(i) for i in range(4)])
    assert eng.verifier.table.num_forked_tokens >= 3 * (PROMPT_LEN - 1)
    alone = [engine().generate([choice(i)])[0] for i in range(4)]
    again = engine().generate([choice(i) for i in range(4)])
    for t, a, r in zip(together, alone, again):
        assert t.token_ids == a.token_ids == r.token_ids
        assert [lp.logprob for lp in t.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-12)
    if params.seed is not None:
        assert len({tuple(t.token_ids) for t in together}) > 1  # independent samples, not copies
