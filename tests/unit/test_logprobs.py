"""Logprobs of emitted and prompt tokens equal an independent target forward (float64), speculation on or off."""

from __future__ import annotations

import math

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.logprobs import token_logprobs
from s2d_ray.core.policy import FixedK
from s2d_ray.core.sampling import logits_to_probs
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams
from test_trees import repetitive_prompts, tree_engine

TOP_N = 5


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def reference_logp(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """Row j: log-probabilities of token j+1 from a plain HF forward over the whole sequence (no cache, no engine)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]  # [len-1, V]
    if params.greedy:
        return logits.log_softmax(-1)
    return logits_to_probs(logits, params).log()  # what the sampler drew from


def engines(target, k: int = 4):
    yield "ar", SpecEngine(TargetVerifier(target))
    yield "s2d", SpecEngine(TargetVerifier(target), SortedDrafter(noisy_draft(target)), policy=FixedK(k))
    yield "tree", tree_engine(target, width=3, lookup=True)  # emitted rows follow the accepted tree path


def check_against_reference(target, prompt, res, params):
    ref = reference_logp(target, prompt + res.token_ids, params)
    gen = ref[len(prompt) - 1:]
    assert len(res.logprobs) == len(res.token_ids)
    for j, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.token == tok
        assert lp.logprob == pytest.approx(float(gen[j, tok]), abs=1e-9)
        values, ids = torch.topk(gen[j], TOP_N)
        assert [i for i, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-9)
    assert res.prompt_logprobs[0] is None
    for j, lp in enumerate(res.prompt_logprobs[1:]):
        assert lp.token == prompt[j + 1]
        assert lp.logprob == pytest.approx(float(ref[j, prompt[j + 1]]), abs=1e-9)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
    SamplingParams(temperature=1.3, seed=5),
], ids=["greedy", "tk-tp", "t1.3"])
def test_logprobs_equal_an_independent_forward_with_and_without_speculation(target, params):
    prompts = random_prompts(4, seed=2) + repetitive_prompts(2, seed=2)
    by_mode = {}
    for mode, engine in engines(target):
        reqs = [GenerationRequest(f"s{i}", p, 20, params, logprobs=TOP_N, prompt_logprobs=True)
                for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        for p, res in zip(prompts, out):
            check_against_reference(target, p, res, params)
            # Alternatives past top-k / top-p are -inf; the chosen token never is.
            assert all(math.isfinite(lp.logprob) for lp in res.logprobs)
        by_mode[mode] = out
        if mode != "ar":
            assert sum(r.metrics["num_accepted_draft_tokens"] for r in out) > 0  # speculation really happened
    if params.greedy:  # same tokens, so the same numbers with speculation on and off
        for a, s in [pair for mode in ("s2d", "tree") for pair in zip(by_mode["ar"], by_mode[mode])]:
            assert a.token_ids == s.token_ids
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in s.logprobs], abs=1e-12)
            assert [[i for i, _ in x.top] for x in a.logprobs] == [[i for i, _ in x.top] for x in s.logprobs]


def test_logprobs_off_by_default_and_zero_means_chosen_only(target):
    prompt = random_prompts(1, seed=4)[0]
    engine = SpecEngine(TargetVerifier(target))
    off, zero = engine.generate([GenerationRequest("a", prompt, 6), GenerationRequest("b", prompt, 6, logprobs=0)])
    assert off.logprobs is None and off.prompt_logprobs is None
    assert len(zero.logprobs) == 6 and all(lp.top == () for lp in zero.logprobs)
    assert zero.prompt_logprobs is None


def test_prompt_rows_only_in_the_first_round_and_kv_freed(target):
    """The prompt is scored once; later rounds ask for k + 1 rows as usual, and the verifier ends empty."""
    prompt = random_prompts(1, seed=5, lo=12, hi=13)[0]
    verifier = TargetVerifier(target)
    asked: list[int] = []
    score = verifier.score

    def spy(requests):
        asked.extend(r.num_logits for r in requests)
        return score(requests)

    verifier.score = spy
    engine = SpecEngine(verifier, SortedDrafter(noisy_draft(target)), policy=FixedK(3))
    res = engine.generate([GenerationRequest("a", prompt, 10, prompt_logprobs=True, logprobs=1)])[0]
    assert asked[0] == len(prompt) and all(n <= 4 for n in asked[1:])  # the prompt round drafts nothing
    assert len(res.prompt_logprobs) == len(prompt)
    assert verifier.num_active == 0


def test_token_logprobs_hand_checked():
    logits = torch.tensor([[0.0, math.log(3.0), -1e9]], dtype=torch.float64)  # p = [1/4, 3/4, 0]
    (lp,) = token_logprobs(logits, [0], SamplingParams(), top_n=2)
    assert lp.logprob == pytest.approx(math.log(0.25))
    assert lp.top == ((1, pytest.approx(math.log(0.75))), (0, pytest.approx(math.log(0.25))))
    # top_k = 1 at temperature 1: all mass on token 1, token 0 filtered out.
    (lp,) = token_logprobs(logits, [1], SamplingParams(temperature=1.0, top_k=1), top_n=2)
    assert lp.logprob == 0.0 and lp.top[1][1] == float("-inf")
