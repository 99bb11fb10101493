"""Prompt logprobs are reduced to top-n where the logits are (ScoreRequest.prompt): the engine gets the same prompt
logprobs as from full rows (tiny float64 target, greedy and sampling rules, blocks smaller than the prompt), and what
a target deployment ships for a prompt of P tokens is O(P x n) bytes, not O(P x vocabulary)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core import logprobs
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import PromptScoring, SamplingParams, ScoredPrompt, ScoreRequest
from s2d_ray.serve.replica import score_counted

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, vocab_size=VOCAB)


class FullRows:
    """A verifier that ignores `prompt` (the full-logits path: the engine reduces the rows itself); `answers` records
    what each call returned."""

    def __init__(self, verifier: TargetVerifier, reduce: bool) -> None:
        self.verifier, self.reduce, self.answers = verifier, reduce, []

    def score(self, requests):
        if not self.reduce:
            requests = [dataclasses.replace(r, prompt=None) for r in requests]
        out = self.verifier.score(requests)
        self.answers += out
        return out

    def release(self, seq_id):
        self.verifier.release(seq_id)


def _run(target, reduce: bool, params: SamplingParams, top_n: int | None, speculate: bool):
    shim = FullRows(TargetVerifier(target), reduce)
    drafter = SortedDrafter(noisy_draft(target)) if speculate else None
    engine = SpecEngine(shim, drafter, policy=FixedK(3))
    prompts = random_prompts(4, vocab_size=VOCAB, seed=7, lo=5, hi=30)
    reqs = [GenerationRequest(f"s{i}", p, 6, params, logprobs=top_n, prompt_logprobs=True)
            for i, p in enumerate(prompts)]
    return engine.generate(reqs), shim.answers


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)],
                         ids=["greedy", "tk-tp"])
@pytest.mark.parametrize("top_n", [None, 0, 5])
def test_reduced_prompt_logprobs_equal_the_full_rows_path(target, monkeypatch, params, top_n):
    monkeypatch.setattr(logprobs, "REDUCE_BLOCK", 4)  # prompts of 5-29 tokens: several blocks each
    full, full_answers = _run(target, False, params, top_n, speculate=True)
    reduced, answers = _run(target, True, params, top_n, speculate=True)
    assert sum(isinstance(a, ScoredPrompt) for a in answers) == 4  # one per prompt, in its first round
    assert not any(isinstance(a, ScoredPrompt) for a in full_answers)  # the control really took the full rows
    for a, b in zip(full, reduced):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token == y.token
            assert y.logprob == pytest.approx(x.logprob, abs=1e-12)
            assert [i for i, _ in y.top] == [i for i, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-12)
            assert len(y.top) == (top_n or 0)
        assert [x.logprob for x in a.logprobs or []] == pytest.approx([x.logprob for x in b.logprobs or []],
                                                                      abs=1e-12)


def test_the_verifier_refuses_prompt_rows_it_cannot_score(target):
    verifier = TargetVerifier(target)
    with pytest.raises(ValueError, match="prompt rows"):
        verifier.score([ScoreRequest("a", [1, 2, 3], 3, prompt=PromptScoring(3, 1))])  # the last row has no next
    with pytest.raises(ValueError, match="prompt rows"):
        verifier.score([ScoreRequest("b", [1, 2, 3], 2, parents=[-1], prompt=PromptScoring(1, 1))])


@pytest.mark.parametrize("reduce", [True, False], ids=["reduced", "full-rows-control"])
def test_a_prompt_logprobs_answer_ships_o_p_times_n_bytes(target, reduce):
    """What `score_counted` returns is what a target deployment pickles back to the router."""
    prompt = random_prompts(1, vocab_size=VOCAB, seed=3, lo=200, hi=201)[0]
    top_n, n_prompt = 2, len(prompt) - 1
    req = ScoreRequest("p", prompt, len(prompt), prompt=PromptScoring(n_prompt, top_n) if reduce else None)
    out, _ = score_counted(TargetVerifier(target), [req], [0])
    shipped = len(pickle.dumps(out))
    per_row = 8 * (1 + 2 * top_n)  # float64 logprob + top_n (id, logprob)
    compact = n_prompt * per_row + VOCAB * 8  # + the round's own row of logits
    if reduce:
        assert isinstance(out[0], ScoredPrompt) and out[0].top_ids.shape == (n_prompt, top_n)
        assert shipped < compact + 4096  # pickling overhead is constant
    else:  # full rows: P x V float64, what the reduced answer must not be
        assert shipped > n_prompt * VOCAB * 8
    # The control tells the two apart: at V = 96 the full rows are already > 4x the compact answer.
    assert n_prompt * VOCAB * 8 > 4 * (compact + 4096)


def test_prompt_logprobs_are_bounded_by_the_prompt_limit_unless_an_operator_sets_one():
    from s2d_ray.serve.app_config import Limits
    from s2d_ray.serve.openai_protocol import GenerateRequest
    from s2d_ray.serve.prepare import RequestError, check_logprobs

    req = GenerateRequest(model="m", prompt_token_ids=[1, 2], logprobs=1, prompt_logprobs=True)
    check_logprobs(req, 4096, Limits())  # default: no bound of its own (max_prompt_tokens still applies)
    with pytest.raises(RequestError, match="echo / prompt logprobs the limit is 64"):  # an operator's bound holds
        check_logprobs(req, 65, Limits(max_prompt_logprobs_tokens=64))
    check_logprobs(req.model_copy(update={"prompt_logprobs": False}), 65, Limits(max_prompt_logprobs_tokens=64))
