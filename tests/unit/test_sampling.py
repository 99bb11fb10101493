"""Speculative sampling follows the target distribution exactly; wrong acceptance rules are caught."""

from __future__ import annotations

import itertools

import pytest
import torch

from core_fixtures import noisy_draft, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.sampling import logits_to_probs, rejection_sample, sample
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams

V = 6




def wrong_residual(draft_tokens, q, target_logits, params, generator):
    """Wrong: on rejection draw from p instead of norm(max(0, p - q))."""
    p = logits_to_probs(target_logits, params)
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        if float(torch.rand(1, generator=generator)) >= min(1.0, float(p[i, x] / q[i, x])):
            return i, sample(p[i], generator)
    return k, sample(p[k], generator)


def accept_by_ratio_q_over_p(draft_tokens, q, target_logits, params, generator):
    """Wrong: the ratio inverted, min(1, q(x)/p(x)); residual as in the paper."""
    p = logits_to_probs(target_logits, params)
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        if float(torch.rand(1, generator=generator)) >= min(1.0, float(q[i, x] / p[i, x])):
            res = (p[i] - q[i]).clamp_min(0)
            return i, sample(res / res.sum(), generator)
    return k, sample(p[k], generator)


def first_two_tokens(rule, p_logits, q, n, params, seed=0):
    """Histogram of the first two emitted tokens over n rounds with context-independent p and q (k=2)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.float64)
    second_p = logits_to_probs(p_logits[1:], params)
    for _ in range(n):
        draft = [sample(q[i], gen) for i in range(2)]
        n_acc, nxt = rule(draft, q, p_logits, params, gen)
        out = draft[:n_acc] + [nxt]
        if len(out) < 2:  # a rejection at position 0: the next round would draw token 2 from p[1]
            out.append(sample(second_p[0], gen))
        counts[out[0], out[1]] += 1
    return counts / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.fixture(scope="module")
def dists():
    gen = torch.Generator().manual_seed(3)
    p_logits = torch.randn(3, V, generator=gen, dtype=torch.float64) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen, dtype=torch.float64) * 1.5, -1)
    return p_logits, q


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_matches_target_and_converges(dists, params):
    p_logits, q = dists
    p = logits_to_probs(p_logits, params)
    exact = p[0][:, None] * p[1][None, :]
    err_small = tv(first_two_tokens(rejection_sample, p_logits, q, 500, params), exact)
    err_large = tv(first_two_tokens(rejection_sample, p_logits, q, 8000, params, seed=1), exact)
    assert err_large < 0.05
    assert err_large < err_small  # more samples close in on p (convergence, not luck)


@pytest.mark.parametrize("rule", [wrong_residual, accept_by_ratio_q_over_p])
def test_wrong_acceptance_rules_fail_the_same_check(dists, rule):
    params = SamplingParams(temperature=1.0)
    p_logits, q = dists
    p = logits_to_probs(p_logits, params)
    exact = p[0][:, None] * p[1][None, :]
    assert tv(first_two_tokens(rule, p_logits, q, 8000, params, seed=1), exact) > 0.08


def test_logits_to_probs_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert logits_to_probs(logits, SamplingParams())[0].tolist() == [1, 0, 0, 0, 0]
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (top2[2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    nucleus = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    assert nucleus[0] > 0 and nucleus[1] > 0 and (nucleus[2:] == 0).all()  # 0.64 < 0.7 needs the second token


def exact_two_token_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)
        vocab = p1.shape[0]
        ids = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = logits_to_probs(model(ids).logits[:, -1], params)
    return p1[:, None] * p2


def exact_second_and_third(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's joint of output tokens 2 and 3 (token 1 summed out): what the engine's first drafting round
    decides (the prompt's round drafts nothing, so token 1 is the target's own sample or a lookup node's)."""
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)
    return sum(p1[t] * exact_two_token_distribution(model, prompt + [t], params) for t in range(p1.shape[0]))


def pair_histogram(engine: SpecEngine, vocab: int, prompt, params, n) -> tuple[torch.Tensor, list]:
    """Empirical joint of output tokens 2 and 3 over n seeded requests, and the results.

    Each request decodes 4 tokens: after the prompt's round (token 1) a row can still use 2 draft tokens plus the
    bonus, so the first drafting round drafts k = 2 and decides tokens 2 and 3 itself (with 3 tokens it drafted one)."""
    reqs = [GenerationRequest(f"s{i}", prompt, 4, SamplingParams(params.temperature, params.top_k, params.top_p, i))
            for i in range(n)]
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    results = engine.generate(reqs)
    for res in results:
        counts[res.token_ids[1], res.token_ids[2]] += 1
    return counts / n, results


def engine_pair_histogram(target, drafter, sampler, prompt, params, n) -> torch.Tensor:
    engine = SpecEngine(TargetVerifier(target), drafter, FixedK(2), sampler=sampler)
    return pair_histogram(engine, target.config.vocab_size, prompt, params, n)[0]


@pytest.mark.parametrize("sampler,ok", [(rejection_sample, True), (accept_by_ratio_q_over_p, False)])
def test_engine_samples_follow_target_distribution(sampler, ok):
    """End to end through draft, batched verification and commit: output tokens 2-3 (both drafted, k = 2, and
    accepted or resampled in one round) ~ the target's joint; a wrong acceptance rule is caught."""
    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    drafter = SortedDrafter(noisy_draft(target, noise=0.3, thresholds=[0.3, 0.3, 0.0]))
    params = SamplingParams(temperature=1.0)
    prompt = [3, 5, 7]
    exact = exact_second_and_third(target, prompt, params)
    emp = engine_pair_histogram(target, drafter, sampler, prompt, params, 6000)  # right rule 0.045, wrong 0.163
    err = tv(emp, exact)
    assert (err < 0.06) if ok else (err > 0.06), err


def test_reduced_vocabulary_draft_still_samples_the_target_distribution():
    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    drafter = SortedDrafter(noisy_draft(target, noise=0.3, thresholds=[0.3, 0.3, 0.0]).with_vocab(torch.arange(0, 5)))
    params = SamplingParams(temperature=1.0)
    exact = exact_second_and_third(target, [3, 5, 7], params)
    emp = engine_pair_histogram(target, drafter, rejection_sample, [3, 5, 7], params, 6000)  # TV 0.061 at 3000: noise
    assert tv(emp, exact) < 0.06
