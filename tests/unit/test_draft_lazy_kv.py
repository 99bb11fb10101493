"""Lazy KV fill and rollback: every draft distribution equals a from-scratch pass through all layers (float64)."""

from __future__ import annotations

import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.types import DraftRequest, SamplingParams


def exit_distribution(draft: SortedDraft, tokens: list[int], exit_layer: int) -> torch.Tensor:
    """Reference: the whole sequence through layers 1..exit_layer with a fresh cache, no laziness."""
    stack = draft.stack
    cache = stack.new_cache()
    positions = torch.arange(len(tokens))[None]
    h = stack.embed(torch.tensor([tokens]))
    for seg, e in enumerate(stack.exit_layers):
        h = stack.run_segment(seg, h, torch.tensor([0]), positions, cache)
        if e == exit_layer:
            return torch.softmax(stack.logits(h[0, -1]), -1)
    raise AssertionError(exit_layer)


def test_lazy_fill_and_rollback_match_full_computation():
    target = tiny_target(seed=2)
    draft = noisy_draft(target, thresholds=[0.05, 0.03, 0.0])
    drafter = SortedDrafter(draft)
    params = SamplingParams(temperature=1.0, seed=0)
    prompts = random_prompts(3, seed=4)
    seqs = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    gen = torch.Generator().manual_seed(0)
    exits_seen: set[int] = set()
    for round_ in range(10):
        reqs = [DraftRequest(sid, toks, 4, params) for sid, toks in seqs.items()]
        for req, prop in zip(reqs, drafter.propose(reqs)):
            ctx = list(req.tokens)
            for tok, q, e in zip(prop.tokens, prop.q, prop.exits):
                ref = exit_distribution(draft, ctx, e)
                assert torch.allclose(q, ref, atol=1e-10), (round_, req.seq_id, e)
                ctx.append(tok)
                exits_seen.add(e)
            # Commit a random-length prefix of the draft plus a token the draft did not propose (a rejection).
            n_keep = int(torch.randint(0, len(prop.tokens) + 1, (1,), generator=gen))
            seqs[req.seq_id] = req.tokens + prop.tokens[:n_keep] + [int(torch.randint(3, 96, (1,), generator=gen))]
    assert exits_seen == {1, 2, 3}


def test_prefix_mismatch_recomputes_instead_of_reusing_stale_kv():
    target = tiny_target(seed=3)
    draft = noisy_draft(target)
    drafter = SortedDrafter(draft)
    params = SamplingParams(temperature=1.0, seed=1)
    prompt = random_prompts(1, seed=8, lo=10, hi=11)[0]
    drafter.propose([DraftRequest("a", prompt, 5, params)])
    edited = prompt[:4] + [(prompt[4] + 1) % 96] + prompt[5:]  # same id, different history (e.g. another replica)
    prop = drafter.propose([DraftRequest("a", edited, 3, params)])[0]
    ctx = list(edited)
    for tok, q, e in zip(prop.tokens, prop.q, prop.exits):
        assert torch.allclose(q, exit_distribution(draft, ctx, e), atol=1e-10)
        ctx.append(tok)
    drafter.release("a")
    assert drafter.num_active == 0
    assert all(float(t[0].abs().sum()) == 0.0 for t in drafter.cache.keys)  # freed row holds no stale state
