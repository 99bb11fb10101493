"""Rounds where speculation cannot pay are plain decoding with nothing else on them (no drafter call, no tree
shaping), and every round's time is split into draft, verify, prompt and host work (core/profile.py), shown by the
in-process twin of `s2d bench serve --twin`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from s2d_ray.bench.serve_report import profile_lines
from s2d_ray.bench.twin import Twin, run_twin_level
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.costs import CostModel
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.target import TargetVerifier
from test_engine_exact import reference_greedy

# verify(B, 2) above twice a step: no first draft depth can pay, whatever the measured scale and hit rate.
STEEP = CostModel({1: {1: 10.0, 2: 40.0, 8: 160.0}}, [0.5], 0.1)


def engine_with(costs: CostModel | None, lookup: bool = False):
    target = tiny_target(seed=3)
    draft = SortedDrafter(noisy_draft(target))
    drafter = TreeDrafter(draft, PromptLookup()) if lookup else draft
    calls = []
    original = drafter.propose
    drafter.propose = lambda reqs: calls.append(len(reqs)) or original(reqs)
    budget = SpeculationBudget(TreeShape(width=2, lookup=lookup, max_nodes=8), costs, max_depth=4)
    return target, SpecEngine(TargetVerifier(target, kernels=KERNELS), drafter, budget=budget), calls


@pytest.mark.parametrize("costs, speculates", [(STEEP, False), (None, True)])  # the control: unpriced drafting
def test_rounds_that_cannot_pay_are_plain_with_no_draft_call(costs, speculates):
    target, engine, calls = engine_with(costs)
    prompts = random_prompts(3, seed=5)
    out = engine.generate([GenerationRequest(f"s{i}", p, 20) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, out):
        assert r.token_ids == reference_greedy(target, p, 20)
    profile = engine.profile.summary()
    assert bool(calls) == speculates  # the control: where drafting pays, the drafter is called
    assert ("speculative" in profile) == speculates
    if not speculates:
        assert set(profile) == {"plain"} and profile["plain"]["draft_ms_per_token"] == 0.0
        assert profile["plain"]["prompt_ms_per_token"] > 0  # the first round filled the prompts
    assert sum(p["tokens"] for p in profile.values()) == 60


def test_twin_level_reports_the_profile():
    _, engine, _ = engine_with(None, lookup=True)
    twin = Twin(SimpleNamespace(engine=engine), random_prompts(4, seed=6), ())
    level = run_twin_level(twin, concurrency=2, requests=4, max_tokens=12)
    profile = level["profile"]
    assert sum(p["tokens"] for p in profile.values()) == level["output_tokens"] == 48
    assert sum(p["rounds"] for p in profile.values()) == level["rounds"]
    for p in profile.values():
        parts = sum(p[f"{k}_ms_per_token"] for k in ("draft", "verify", "prompt", "host"))
        assert parts == pytest.approx(p["ms_per_token"], rel=1e-6, abs=1e-9)
    lines = profile_lines([{"concurrency": 2, "pair": 1, "variant": "speculative", "twin": level}])
    assert any("| speculative |" in line for line in lines)
