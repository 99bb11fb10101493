"""Long prompts run in passes of `prefill_chunk` positions (KV first, the last pass with the wanted logits): the
logits equal one pass, for plain rows, prompt-logprob rows and token trees behind a long prefix; the engine's greedy
output stays the target's. A last pass that splits a tree from its prefix is caught."""

from __future__ import annotations

import torch

import s2d_ray.core.target as target_mod
from core_fixtures import noisy_draft, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, SamplingParams, ScoreRequest
from test_engine_exact import reference_greedy
from test_length_groups import spy_forwards


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_round() -> list[ScoreRequest]:
    long, mid, short, tree_prefix = prompt(70, 1), prompt(45, 2), prompt(5, 3), prompt(37, 4)
    parents = [-1, -1, 0, 0, 2, 1]  # two roots, a chain under the first, a child under the second
    return [
        ScoreRequest("long", long, 1),
        ScoreRequest("mid", mid, 1),
        ScoreRequest("short", short, 1),
        ScoreRequest("logprobs", prompt(29, 5), 29),  # prompt logprobs: every position
        ScoreRequest("tree", tree_prefix + [7, 9, 11, 12, 13, 14], len(parents) + 1, parents=parents),
    ]


def next_round(reqs: list[ScoreRequest]) -> list[ScoreRequest]:
    """Each sequence grows by a few tokens (the tree's first root and its child accepted)."""
    out = []
    for r in reqs:
        base = r.tokens[: len(r.tokens) - len(r.parents)] + [7, 11] if r.parents else r.tokens + [5, 6]
        out.append(ScoreRequest(r.seq_id, base + [8], 2))
    return out


def run(chunk: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    verifier = TargetVerifier(tiny_target(seed=7), prefill_chunk=chunk)
    shapes = spy_forwards(verifier.stack)
    reqs = first_round()
    return verifier.score(reqs) + verifier.score(next_round(reqs)), shapes


def test_chunked_prefill_equals_one_pass():
    whole, whole_shapes = run(0)
    chunked, chunked_shapes = run(16)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert max(w for _, w in whole_shapes) >= 70
    # every pass of the chunked run is at most 16 positions, except a tree's last pass (its 6 nodes + the prefix end)
    assert max(w for _, w in chunked_shapes) <= 16
    assert len(chunked_shapes) > len(whole_shapes)


def test_tree_split_from_its_prefix_is_caught(monkeypatch):
    whole, _ = run(0)
    # wrong: the last pass is just the last `chunk` positions, so the tree's first nodes go in a plain causal pass
    monkeypatch.setattr(target_mod, "_last_pass_start", lambda req, start, end, chunk: max(start, end + 1 - chunk))
    try:
        broken, _ = run(4)
    except RuntimeError:  # the tree's layout no longer fits its pass
        return
    assert not torch.allclose(whole[4], broken[4])


def test_engine_output_unchanged_with_small_chunks():
    target = tiny_target(seed=3)
    engine = SpecEngine(TargetVerifier(target, prefill_chunk=8), SortedDrafter(noisy_draft(target), prefill_chunk=6),
                        FixedK(3))
    prompts = {"a": prompt(53, 11), "b": prompt(9, 12), "c": prompt(31, 13)}
    out = engine.generate([GenerationRequest(k, p, 24) for k, p in prompts.items()])
    for r in out:
        assert r.token_ids == reference_greedy(target, prompts[r.seq_id], 24)


def draft_rounds(chunk: int) -> tuple[list, list[tuple[int, int]]]:
    """Three propose rounds of a long and a short prompt (chains and a tree), as the engine would send them."""
    target = tiny_target(seed=5)
    drafter = SortedDrafter(noisy_draft(target, exits=[1, 2, 3]), prefill_chunk=chunk)
    shapes = spy_forwards(drafter.stack)
    seqs = {"long": prompt(61, 21), "short": prompt(7, 22)}
    out = []
    for r in range(3):
        props = drafter.propose([DraftRequest("long", seqs["long"], 3, SamplingParams()),
                                 DraftRequest("short", seqs["short"], 2, SamplingParams(), tree=True, width=2)])
        out.append([(p.tokens, p.exits, p.parents) for p in props])
        seqs["long"] = seqs["long"] + props[0].tokens[:2] + [5]  # two accepted, then the target's token
        seqs["short"] = seqs["short"] + [props[1].tokens[0], 9]
    return out, shapes


def test_draft_chunked_prefill_proposes_the_same():
    whole, whole_shapes = draft_rounds(0)
    chunked, chunked_shapes = draft_rounds(8)
    assert whole == chunked
    assert max(w for _, w in whole_shapes) >= 61
    assert max(w for _, w in chunked_shapes) <= 9
