"""Exit thresholds per request row: targets whose profiles differ only in thresholds share one draft forward and each
gets exactly the proposals it would get from a drafter of its own (float64)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, SamplingParams
from s2d_ray.errors import RequestError

LOW = (0.05, 0.03, 0.0)  # the draft's own: rows exit early often
HIGH = (0.6, 0.4, 0.0)  # another target's profile: rows go deeper


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=2)


def same(a, b) -> bool:
    return a.tokens == b.tokens and a.exits == b.exits and (
        (a.q is None and b.q is None) or torch.allclose(a.q, b.q, atol=1e-10))  # batch shape moves the last bits


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_mixed_thresholds_in_one_call_equal_separate_drafters(target, params):
    draft = noisy_draft(target, thresholds=list(LOW))
    shared = SortedDrafter(draft)
    alone = {LOW: SortedDrafter(draft), HIGH: SortedDrafter(draft.with_exits(draft.spec.exit_layers, list(HIGH)))}
    seqs = {f"s{i}": (p, LOW if i % 2 else HIGH) for i, p in enumerate(random_prompts(6, seed=5))}
    gen = torch.Generator().manual_seed(0)
    exits = {LOW: set(), HIGH: set()}
    forwards = {"calls": 0}
    step = shared._step

    def counted(*a):
        forwards["calls"] += 1
        return step(*a)

    shared._step = counted
    for round_ in range(8):
        reqs = [DraftRequest(sid, toks, 4, params, thresholds=None if th == LOW else th) for sid, (toks, th) in seqs.items()]
        before = forwards["calls"]
        mixed = shared.propose(reqs)
        assert forwards["calls"] - before <= 4  # one draft step per depth for all rows of both profiles
        for req, prop in zip(reqs, mixed):
            th = seqs[req.seq_id][1]
            ref = alone[th].propose([replace(req, thresholds=None)])[0]
            assert same(prop, ref), (round_, req.seq_id)
            exits[th] |= set(prop.exits)
            n_keep = int(torch.randint(0, len(prop.tokens) + 1, (1,), generator=gen))
            rejected = prop.tokens[n_keep] if n_keep < len(prop.tokens) else -1
            fix = int(torch.randint(3, 96, (1,), generator=gen))
            fix = fix if fix != rejected else 3 + (fix - 2) % 93  # a rejection commits another token
            tokens = req.tokens + prop.tokens[:n_keep] + [fix]
            seqs[req.seq_id] = (tokens, th)
    # The profiles must really differ in behaviour, or this proves little.
    assert sum(exits[LOW]) / len(exits[LOW]) < sum(exits[HIGH]) / len(exits[HIGH]) or exits[LOW] != exits[HIGH]


class StampedDrafter:
    """Stamps one target's thresholds on its rows, as the draft deployment does."""

    def __init__(self, inner: SortedDrafter, thresholds: tuple[float, ...]) -> None:
        self.inner, self.th = inner, thresholds

    def propose(self, requests):
        return self.inner.propose([replace(r, thresholds=self.th) for r in requests])

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)


def test_greedy_output_unchanged_with_row_thresholds(target):
    prompts = random_prompts(4, seed=7)
    reqs = [GenerationRequest(f"s{i}", p, 30) for i, p in enumerate(prompts)]
    ar = SpecEngine(TargetVerifier(target)).generate(reqs)
    drafter = StampedDrafter(SortedDrafter(noisy_draft(target, thresholds=list(LOW))), HIGH)
    out = SpecEngine(TargetVerifier(target), drafter, policy=FixedK(4)).generate(reqs)
    assert [o.token_ids for o in out] == [a.token_ids for a in ar]
    assert sum(o.metrics["num_accepted_draft_tokens"] for o in out) > 0


def test_wrong_threshold_count_is_a_clear_error(target):
    drafter = SortedDrafter(noisy_draft(target))
    with pytest.raises(RequestError, match="one threshold per exit"):
        drafter.propose([DraftRequest("s", [5, 6, 7], 2, thresholds=(0.5,))])
