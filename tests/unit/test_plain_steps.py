"""Several plain greedy steps per verifier call (`ScoreRequest.steps`, `core/steps.score_steps`): the tokens are the
target's greedy ones, every stop rule still holds, and a plain round makes fewer calls (float64 tiny models)."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.steps import score_steps
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams, ScoreRequest
from s2d_ray.serve.replica import score_counted
from test_engine_exact import reference_greedy


@pytest.fixture(scope="module")
def target():
    """A tiny target whose greedy path varies (an untied random head: the tied one keeps repeating one token, which
    would hide a step that read the wrong position)."""
    model = tiny_target(seed=4)
    gen = torch.Generator().manual_seed(0)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=gen,
                                                          dtype=model.lm_head.weight.dtype))
    return model


class Shipped:
    """The verifier as the router sees it through a target deployment (`score_counted`), counting calls."""

    def __init__(self, verifier: TargetVerifier) -> None:
        self.verifier, self.calls = verifier, []  # per call: {seq_id: steps asked}

    def score(self, requests):
        self.calls.append({r.seq_id: r.steps for r in requests})
        return score_counted(self.verifier, requests, [0] * len(requests))[0]

    def release(self, seq_id):
        self.verifier.release(seq_id)


def test_score_steps_answers_the_targets_greedy_ids_and_stops_at_a_stop_id(target):
    prompts = random_prompts(3, seed=1)
    ref = [reference_greedy(target, p, 8) for p in prompts]
    verifier = TargetVerifier(target)
    out = score_steps(verifier.score, [
        ScoreRequest("a", prompts[0], 1, argmax_only=True, steps=5),
        ScoreRequest("b", prompts[1], 1, argmax_only=True, steps=6, stop_ids=(ref[1][1],)),
        ScoreRequest("c", prompts[2], 1),  # an ordinary row in the same call: its logits, one step
    ])
    assert out[0].tolist() == ref[0][:5]
    assert out[1].tolist() == ref[1][: ref[1].index(ref[1][1]) + 1]  # stopped at the stop id, not at 6
    assert out[2].shape == (1, target.config.vocab_size) and int(out[2][0].argmax()) == ref[2][0]
    # the KV the steps left behind is the greedy path's: the next plain call continues it exactly
    nxt = score_steps(verifier.score, [ScoreRequest("a", prompts[0] + ref[0][:5], 1, argmax_only=True, steps=3)])
    assert nxt[0].tolist() == ref[0][5:8]


@pytest.mark.parametrize("bad", [dict(argmax_only=False), dict(num_logits=2), dict(parents=[-1])])
def test_steps_need_a_plain_greedy_row(target, bad):
    prompt = random_prompts(1, seed=2)[0]
    kwargs = {"num_logits": 1, "argmax_only": True, "steps": 3, **bad}
    with pytest.raises(ValueError, match="plain greedy row"):
        score_steps(TargetVerifier(target).score, [ScoreRequest("a", prompt, **kwargs)])


def test_plain_engine_takes_several_steps_per_call_with_every_stop_rule(target):
    prompts = random_prompts(4, seed=3)
    ref = [reference_greedy(target, p, 13) for p in prompts]
    shipped = Shipped(TargetVerifier(target))
    engine = SpecEngine(shipped, plain_steps=4, detokenize=lambda ids: " ".join(f"t{i}" for i in ids))
    reqs = [GenerationRequest("n", prompts[0], 13),  # 13 = 1 + 4 + 4 + 4: the prompt's call is one pass
            GenerationRequest("eos", prompts[1], 13, stop_token_ids=(ref[1][5],)),
            GenerationRequest("str", prompts[2], 13, stop_strings=(f"t{ref[2][2]}",))]
    out = {r.seq_id: r for r in engine.generate(reqs)}
    assert out["n"].token_ids == ref[0] and out["n"].finish_reason == "length"
    assert out["eos"].token_ids == ref[1][: ref[1].index(ref[1][5]) + 1] and out["eos"].finish_reason == "stop"
    first = next(i for i in range(13) if f"t{ref[2][2]}" in " ".join(f"t{t}" for t in ref[2][: i + 1]))
    assert out["str"].token_ids == ref[2][: first + 1] and out["str"].finish_reason == "stop"
    assert len(shipped.calls) == 4 and [c["n"] for c in shipped.calls] == [1, 4, 4, 4]  # one step each: 13 calls
    assert out["n"].metrics["num_target_forwards"] == 13
    engine.max_context = len(prompts[3]) + 6
    res = engine.generate([GenerationRequest("ctx", prompts[3], 13)])[0]
    assert res.token_ids == ref[3][:6] and res.finish_reason == "length"
    assert shipped.verifier.num_active == 0


def test_a_round_with_draft_tokens_or_a_sampling_row_takes_one_step(target):
    prompts = random_prompts(3, seed=6)
    ref = [reference_greedy(target, p, 10) for p in prompts]
    shipped = Shipped(TargetVerifier(target))
    drafted = []  # per call: did any row carry draft tokens
    score = shipped.score
    shipped.score = lambda requests: (drafted.append(any(r.num_logits > 1 for r in requests)), score(requests))[1]
    engine = SpecEngine(shipped, SortedDrafter(noisy_draft(target)), FixedK(3), plain_steps=4)
    reqs = [GenerationRequest("plain", prompts[0], 10, speculate=False),
            GenerationRequest("spec", prompts[1], 4),
            GenerationRequest("hot", prompts[2], 10, SamplingParams(temperature=0.9, seed=1), speculate=False)]
    out = {r.seq_id: r for r in engine.generate(reqs)}
    assert out["plain"].token_ids == ref[0] and out["spec"].token_ids == ref[1][:4]
    assert any(drafted) and all(s == 1 for c, d in zip(shipped.calls, drafted) if d for s in c.values())
    after = [c for c in shipped.calls if "spec" not in c and "plain" in c and "hot" in c]
    assert after and after[0]["plain"] > 1 and all(c["hot"] == 1 for c in after)  # sampling rows step once


class NoProposals:
    """A drafter that proposes nothing (as when the load-aware budget switches drafting off for the round)."""

    def propose(self, drafts):
        from s2d_ray.core.types import Proposal

        return [Proposal.empty() for _ in drafts]

    def release(self, seq_id):
        pass


def test_rounds_where_speculating_rows_draft_nothing_take_several_steps(target):
    """Speculation on, but no row got draft tokens this round: the round is plain decoding, so it steps like one."""
    prompts = random_prompts(2, seed=8)
    ref = [reference_greedy(target, p, 9) for p in prompts]
    shipped = Shipped(TargetVerifier(target))
    engine = SpecEngine(shipped, NoProposals(), FixedK(3), plain_steps=4)
    out = engine.generate([GenerationRequest(f"s{i}", p, 9) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in out] == ref
    assert [c["s0"] for c in shipped.calls] == [1, 4, 4]


def test_rows_that_opted_out_never_reach_the_drafter(target):
    """A greedy and a sampling row with `speculate=False` beside a speculating one: the drafter never holds a row for
    them (it used to sync them without growing its cache, and releasing the third row's index raised IndexError)."""
    prompts = random_prompts(3, seed=6)
    ref = [reference_greedy(target, p, 10) for p in prompts]
    drafter = SortedDrafter(noisy_draft(target))
    seen: set[str] = set()
    propose = drafter.propose
    drafter.propose = lambda drafts: (seen.update(d.seq_id for d in drafts), propose(drafts))[1]
    engine = SpecEngine(TargetVerifier(target), drafter, FixedK(3))
    reqs = [GenerationRequest("plain", prompts[0], 10, speculate=False),
            GenerationRequest("spec", prompts[1], 4),
            GenerationRequest("hot", prompts[2], 10, SamplingParams(temperature=0.9, seed=1), speculate=False)]
    out = {r.seq_id: r for r in engine.generate(reqs)}
    assert out["plain"].token_ids == ref[0] and out["spec"].token_ids == ref[1][:4] and len(out["hot"].token_ids) == 10
    assert seen == {"spec"} and drafter.num_active == 0


def stepper(engine: SpecEngine, got: dict[str, list[int]]):
    """One engine round per call: its outputs by sequence, their tokens appended to `got`."""

    def step() -> dict:
        outs = {o.seq_id: o for o in engine.step()}
        for seq_id, o in outs.items():
            got[seq_id] += o.new_tokens
        return outs

    return step


def test_a_round_that_fills_a_prompt_is_one_pass(target):
    """A request joining mid-stream: the round that prefills it steps every row once, so its first token (and the
    riding row's next one) returns after one pass, not after the others' extra steps; the tokens stay greedy."""
    prompts = random_prompts(2, seed=11)
    ref = [reference_greedy(target, p, 12) for p in prompts]
    shipped = Shipped(TargetVerifier(target))
    engine = SpecEngine(shipped, plain_steps=4)
    got: dict[str, list[int]] = {"a": [], "b": []}
    step = stepper(engine, got)

    engine.add_request(GenerationRequest("a", prompts[0], 12))
    step(), step()  # a's prompt (one pass), then a plain round of 4 steps
    engine.add_request(GenerationRequest("b", prompts[1], 12))
    outs = step()  # b's prompt, a riding
    assert shipped.calls[-1] == {"a": 1, "b": 1} and len(outs["b"].new_tokens) == 1
    step()
    assert shipped.calls[-1] == {"a": 4, "b": 4}
    while engine.has_unfinished:
        step()
    assert got == {"a": ref[0], "b": ref[1]}
    assert [c["a"] for c in shipped.calls if "a" in c] == [1, 4, 1, 4, 2]  # 12 tokens, 5 calls


def test_with_prompt_chunks_the_round_that_fills_a_prompt_keeps_the_steps(target):
    """Prompt chunks on: a request joining mid-stream fills its prompt in chunks beside the running row, and the round
    that fills its last chunk still steps the running row (and the new one) `plain_steps` times, so chunked prompts
    cost running streams no steps; a round of prompts alone stays one pass (the first token does not wait). The
    tokens stay greedy. The control is the test above: whole prompts make that round one pass."""
    prompts = random_prompts(2, seed=11)
    prompts[1] = prompts[1] * 3  # long enough for two chunks of 8 positions
    ref = [reference_greedy(target, p, n) for p, n in zip(prompts, (40, 12))]
    shipped = Shipped(TargetVerifier(target))
    engine = SpecEngine(shipped, plain_steps=4, prompt_tokens=8)
    got: dict[str, list[int]] = {"a": [], "b": []}
    step = stepper(engine, got)

    engine.add_request(GenerationRequest("a", prompts[0], 40))  # still decoding when b fills
    step()
    assert shipped.calls[-1] == {"a": 1}  # a prompt alone: one pass
    step()
    engine.add_request(GenerationRequest("b", prompts[1], 12))
    rounds = []
    while "b" not in got or not got["b"]:
        before = len(shipped.calls)
        outs = step()
        rounds.append(shipped.calls[before:])
    # b's chunks ride in the first call of rounds where a steps 4 times; the round that fills its last part steps both
    assert len(rounds) > 1 and all(r[0]["a"] == 4 for r in rounds)
    assert rounds[-1][0] == {"a": 4, "b": 4} and len(outs["b"].new_tokens) == 4
    while engine.has_unfinished:
        step()
    assert got == {"a": ref[0], "b": ref[1]}
