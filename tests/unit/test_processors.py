"""Logits processors stay exact under speculation: each target row is processed with its own history, so greedy
chains, trees and lookup equal plain decoding with the same processors, and tree sampling follows the processed
target; a processor given the wrong history is caught. Banned deterministic candidates never reach the verifier."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.penalties import (BadWords, FrequencyPresence, LogitBias, MinTokens, PenaltySpec,
                                    RepetitionPenalty, penalty_processors)
from s2d_ray.core.policy import FixedK
from s2d_ray.core.processors import apply_processors, prune_banned, row_histories
from s2d_ray.core.sampling import logits_to_probs
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import Proposal, SamplingParams
from test_sampling import tv
from test_trees import repetitive_prompts, sampling_tree_engine, tree_engine

NEG = float("-inf")


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


# --- each processor against a hand computation ------------------------------------------------------------------
COMMITTED = [1, 2, 2, 4, 4, 5]  # prompt [1, 2, 2], generated [4, 4, 5]
BRANCHES = [[], [4], [6, 2]]


def rows(vocab: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(len(BRANCHES), vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_frequency_and_presence_count_generated_tokens_only():
    logits = rows()
    out = FrequencyPresence(3, 0.5, 0.25)(COMMITTED, BRANCHES, logits)
    for i, branch in enumerate(BRANCHES):
        counts = Counter(COMMITTED[3:] + branch)
        for j in range(8):
            want = float(logits[i, j]) - counts[j] * 0.5 - (counts[j] > 0) * 0.25
            assert float(out[i, j]) == pytest.approx(want)
    assert out[0, 2] == logits[0, 2] and out[2, 2] == logits[2, 2] - 0.75  # 2 is in the prompt: only generated counts


def test_repetition_penalty_covers_prompt_and_output():
    logits = rows()
    out = RepetitionPenalty(1.5)(COMMITTED, BRANCHES, logits)
    for i, branch in enumerate(BRANCHES):
        seen = set(COMMITTED + branch)
        for j in range(8):
            x = float(logits[i, j])
            want = (x / 1.5 if x > 0 else x * 1.5) if j in seen else x
            assert float(out[i, j]) == pytest.approx(want)


def test_logit_bias_adds_to_listed_tokens():
    logits = rows()
    out = LogitBias(((3, 2.0), (7, -100.0)))(COMMITTED, BRANCHES, logits)
    want = logits.clone()
    want[:, 3] += 2.0
    want[:, 7] -= 100.0
    assert torch.equal(out, want)
    assert not LogitBias(((3, -100.0),)).bans and LogitBias(((3, NEG),)).bans


def test_min_tokens_bans_stop_ids_until_enough_were_generated():
    out = MinTokens(3, 5, (0, 6))(COMMITTED, BRANCHES, rows())  # generated: 3, 4, 5 tokens in rows 0, 1, 2
    assert torch.isneginf(out[:2, [0, 6]]).all() and not torch.isinf(out[2]).any()
    assert not torch.isinf(out[:2, 1:6]).any()


def test_bad_words_single_and_multi_token():
    out = BadWords(3, ((7,), (4, 6), (2, 6)))(COMMITTED, BRANCHES, rows())
    assert torch.isneginf(out[:, 7]).all()  # a one-token word: banned everywhere
    # (4, 6): 6 banned only where the generated tokens end with 4 (row 1); (2, 6): row 2 ends with 2, a generated one.
    assert [bool(torch.isneginf(out[i, 6])) for i in range(3)] == [False, True, True]
    # The prompt ends with 2 but a word straddling the prompt is not the generation's: nothing banned there.
    fresh = BadWords(3, ((2, 6),))([1, 2, 2], [[]], rows()[:1])
    assert not torch.isinf(fresh).any()


def test_spec_defaults_change_nothing_and_order_follows_vllm():
    assert not PenaltySpec().active and penalty_processors(PenaltySpec(), 3, (0,)) == ()
    spec = PenaltySpec(0.1, 0.2, 1.1, ((1, 1.0),), 2, ((5,),))
    assert spec.active
    kinds = [type(p) for p in penalty_processors(spec, 3, (0,))]
    assert kinds == [BadWords, MinTokens, LogitBias, RepetitionPenalty, FrequencyPresence]
    assert penalty_processors(PenaltySpec(min_tokens=4), 3, ()) == ()  # no stop ids: nothing to ban


def test_row_histories_of_chains_and_trees():
    assert row_histories(Proposal([5, 6], None, [1, 1])) == [[], [5], [5, 6]]
    tree = Proposal([5, 6, 7, 8], None, [1] * 4, [-1, 0, -1, 2])
    assert row_histories(tree) == [[], [5], [5, 6], [7], [7, 8]]


# --- greedy: plain == chain == tree == tree + lookup --------------------------------------------------------------
def reference(model, prompt: list[int], n: int, processors, stops=()) -> list[int]:
    """Slow reference: a full forward each step, the processors on its one row, argmax; stops end it."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            row = apply_processors(processors, ids, [[]], model(torch.tensor([ids])).logits[0, -1:])
            ids.append(int(row.argmax()))
            if ids[-1] in stops:
                break
    return ids[len(prompt):]


def engines(target) -> dict[str, SpecEngine]:
    return {"plain": SpecEngine(TargetVerifier(target, kernels=KERNELS)),
            "chain": SpecEngine(TargetVerifier(target, kernels=KERNELS), SortedDrafter(noisy_draft(target)), FixedK(3)),
            "tree": tree_engine(target, 3, False),
            "tree+lookup": tree_engine(target, 3, True, lookup_candidates=2)}


def specs_for(plain: list[int], alt: list[int]) -> dict[str, PenaltySpec]:
    """Specs that change a prompt's unprocessed greedy output (`plain`; the tiny model repeats one token) from its
    first tokens on; `alt` is the output with plain's first token banned."""
    common = Counter(plain).most_common(1)[0][0]
    return {"frequency": PenaltySpec(frequency_penalty=1.5),
            "presence": PenaltySpec(presence_penalty=3.0),
            "repetition": PenaltySpec(repetition_penalty=8.0),
            "bias": PenaltySpec(logit_bias=((common, -100.0), (alt[0], -2.0), ((alt[0] + 1) % 96, 1.0))),
            "min_tokens": PenaltySpec(min_tokens=6, presence_penalty=3.0),  # the stop: what presence emits third
            "bad_words": PenaltySpec(bad_words=((plain[0],), (alt[0], alt[0]))),
            "all": PenaltySpec(0.5, 0.5, 1.3, ((common, -3.0),), 6, ((alt[0], alt[0]),))}


N = 20


@pytest.fixture(scope="module")
def greedy_case(target):
    """Per prompt and spec: the request, its reference output and the unprocessed output. min_tokens stops at the
    token presence alone emits third, all at the unprocessed output's first, so min_tokens holds back a stop."""
    prompts = random_prompts(2, seed=31) + repetitive_prompts(2, seed=31)
    cases = {}
    for i, p in enumerate(prompts):
        plain = reference(target, p, N, ())
        alt = reference(target, p, N, penalty_processors(PenaltySpec(bad_words=((plain[0],),)), len(p), ()))
        presence = reference(target, p, N, penalty_processors(PenaltySpec(presence_penalty=3.0), len(p), ()))
        for name, spec in specs_for(plain, alt).items():
            stops = {"min_tokens": (presence[2],), "all": (plain[0],)}.get(name, ())
            procs = penalty_processors(spec, len(p), stops)
            ref = reference(target, p, N, procs, stops)
            cases[name, i] = (GenerationRequest(f"{name}-{i}", p, N, stop_token_ids=stops, processors=procs), ref,
                              plain)
    return cases


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "tree+lookup"])
def test_greedy_with_processors_equals_plain_processed_decoding(target, greedy_case, mode):
    engine = engines(target)[mode]
    reqs = [req for req, _, _ in greedy_case.values()]
    out = {r.seq_id: r for r in engine.generate(reqs)}
    changed = accepted = 0
    for req, ref, plain in greedy_case.values():
        assert out[req.seq_id].token_ids == ref, req.seq_id
        changed += ref != plain[: len(ref)]
        accepted += out[req.seq_id].metrics["num_accepted_draft_tokens"]
    assert changed == len(greedy_case)  # every processor really changes its output
    assert mode == "plain" or accepted > 0  # and speculation still pays with them on


@dataclass(frozen=True)
class CommittedOnly:
    """WRONG on purpose: every row processed as if it were the first (committed only, no draft tokens)."""

    inner: object

    def __call__(self, committed, branches, logits):
        return self.inner(committed, [[] for _ in branches], logits)


@pytest.mark.parametrize("mode", ["chain", "tree+lookup"])
def test_negative_control_processor_with_the_wrong_history_is_caught(target, greedy_case, mode):
    reqs = [GenerationRequest(req.seq_id, req.prompt_ids, N, stop_token_ids=req.stop_token_ids,
                              processors=tuple(CommittedOnly(p) for p in req.processors))
            for (name, _), (req, _, _) in greedy_case.items() if name in ("frequency", "presence", "all")]
    refs = {req.seq_id: ref for req, ref, _ in greedy_case.values()}
    out = engines(target)[mode].generate(reqs)
    assert sum(r.token_ids != refs[r.seq_id] for r in out) >= 2


def test_logprobs_come_from_the_processed_rows(target):
    p = random_prompts(1, seed=5)[0]
    procs = penalty_processors(PenaltySpec(frequency_penalty=1.0, logit_bias=((7, 3.0),)), len(p), ())
    engine = engines(target)["chain"]
    res = engine.generate([GenerationRequest("s", p, 10, logprobs=2, processors=procs)])[0]
    ids = list(p)
    with torch.no_grad():
        for tok, lp in zip(res.token_ids, res.logprobs):
            row = apply_processors(procs, ids, [[]], target(torch.tensor([ids])).logits[0, -1:])[0]
            logp = row.log_softmax(-1)
            assert lp.token == tok and lp.logprob == pytest.approx(float(logp[tok]))
            assert [t for t, _ in lp.top] == logp.topk(2).indices.tolist()
            ids.append(tok)


# --- sampling: trees follow the processed target --------------------------------------------------------------------
def processed_second_and_third(model, prompt: list[int], params: SamplingParams, procs) -> torch.Tensor:
    """The processed target's joint of output tokens 2 and 3 (token 1 summed out), every row with its history."""
    def probs(seqs: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(seqs)).logits[:, -1]
        return torch.cat([logits_to_probs(apply_processors(procs, s, [[]], logits[i:i + 1]), params)
                          for i, s in enumerate(seqs)])

    with torch.no_grad():
        p1 = probs([prompt])[0]
        vocab = p1.shape[0]
        out = torch.zeros(vocab, vocab, dtype=torch.float64)
        for t1 in range(vocab):
            p2 = probs([prompt + [t1]])[0]
            p3 = probs([prompt + [t1, t2] for t2 in range(vocab)])
            out += p1[t1] * p2[:, None] * p3
    return out


@pytest.mark.parametrize("mode,wrong", [("tree", False), ("tree", True), ("chain", False), ("chain", True)])
def test_sampling_follows_the_processed_target(mode, wrong):
    """Trees (deterministic nodes + lookup) and a chain sampled with the draft's (unprocessed) q both follow the
    processed target's joint of output tokens 2-3; a tree or a sampled chain with its processors given the wrong
    history does not."""
    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    prompt = [3, 5, 3, 5, 3]  # lookup proposes [5, 3, ...]
    params = SamplingParams(temperature=1.0)
    procs = penalty_processors(PenaltySpec(frequency_penalty=1.5, presence_penalty=1.0, bad_words=((3, 5),)),
                               len(prompt), ())
    exact = processed_second_and_third(target, prompt, params, procs)
    used = tuple(CommittedOnly(p) for p in procs) if wrong else procs
    n = 5000
    reqs = [GenerationRequest(f"s{i}", prompt, 4, SamplingParams(1.0, seed=i), processors=used) for i in range(n)]
    counts = torch.zeros(8, 8, dtype=torch.float64)
    engine = sampling_tree_engine(target) if mode == "tree" else SpecEngine(
        TargetVerifier(target), SortedDrafter(noisy_draft(target, noise=0.3, thresholds=[0.3, 0.3, 0.0])), FixedK(2))
    results = engine.generate(reqs)
    for res in results:
        counts[res.token_ids[1], res.token_ids[2]] += 1
    err = tv(counts / n, exact)
    assert sum(r.metrics["num_accepted_draft_tokens"] for r in results) > n // 4  # trees were really accepted
    assert (err > 0.08) if wrong else (err < 0.055), err


# --- pruning ------------------------------------------------------------------------------------------------------
def test_prune_drops_banned_nodes_with_their_subtrees_and_never_sampled_chains():
    ban = penalty_processors(PenaltySpec(bad_words=((6,), (5, 8))), 2, ())
    tree = Proposal([5, 6, 7, 8, 9, 8], None, [1, 1, 1, 1, 1, 0], [-1, 0, 1, 0, -1, 4], [.9, .8, .7, .6, .5, .4])
    kept = prune_banned(ban, [1, 2], tree, 10)  # node 1 (6) and its child 2 go; node 3 (8 after 5) goes; 5 stays
    assert (kept.tokens, kept.parents, kept.scores, kept.exits) == ([5, 9, 8], [-1, -1, 1], [.9, .5, .4], [1, 1, 0])
    chain = Proposal([5, 7, 6, 9], None, [1, 2, 3, 1])
    assert prune_banned(ban, [1, 2], chain, 10).tokens == [5, 7]
    sampled = Proposal([5, 6], torch.full((2, 10), 0.1), [1, 1])
    assert prune_banned(ban, [1, 2], sampled, 10) is sampled  # a q chain is never cut by its tokens' values
    shifts = penalty_processors(PenaltySpec(frequency_penalty=2.0, logit_bias=((6, -100.0),)), 2, ())
    assert prune_banned(shifts, [1, 2], tree, 10) is tree  # finite shifts ban nothing


class CountingVerifier(TargetVerifier):
    """Records, per request, every draft token (chain or tree node) put in front of the target."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored: dict[str, list[int]] = {}

    def score(self, requests):
        for r in requests:
            if r.num_logits > 1:
                self.scored.setdefault(r.seq_id, []).extend(r.tokens[len(r.tokens) - r.num_logits + 1:])
        return super().score(requests)


@pytest.mark.parametrize("prune", [True, False])
def test_banned_candidates_never_reach_the_verifier(target, prune):
    """A bad word the draft and lookup keep proposing is dropped before verification, from an engine's first round
    on (the engine takes the logit width from the verifier); output unchanged."""
    prompts = repetitive_prompts(3, seed=8)
    reqs, refs, banned = [], [], {}
    for i, p in enumerate(prompts):
        word = reference(target, p, N, ())[2]  # a token the unprocessed output has: the draft proposes it
        banned[f"s{i}"] = word
        procs = penalty_processors(PenaltySpec(bad_words=((word,),)), len(p), ())
        reqs.append(GenerationRequest(f"s{i}", p, N, processors=procs))
        refs.append(reference(target, p, N, procs))
    verifier = CountingVerifier(target, kernels=KERNELS)
    drafter = TreeDrafter(SortedDrafter(noisy_draft(target)), PromptLookup(3, 6, candidates=2), alone_ngram=3)
    budget = SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=12), None, max_depth=6)
    engine = SpecEngine(verifier, drafter, FixedK(3), budget=budget)
    if not prune:
        engine.prune = lambda live, proposals: proposals  # the control: without pruning they are verified
    assert engine.vocab == target.config.vocab_size  # known before any row was scored
    out = engine.generate(reqs)
    assert [r.token_ids for r in out] == refs
    leaked = sum(verifier.scored.get(seq, []).count(word) for seq, word in banned.items())
    assert (leaked == 0) if prune else (leaked > 0)
    assert sum(len(v) for v in verifier.scored.values()) > 0
