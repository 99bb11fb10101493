"""Per-replica memory is bounded by configuration: rows and slots grow independently, rows are capped (the least
recently used sequence's row is reclaimed) and outputs stay exact when an evicted sequence comes back (float64)."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.cache import HiddenStore, SlotKVCache
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.rows import limit_rows
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, SamplingParams, ScoreRequest
from s2d_ray.errors import CapacityError
from test_draft_lazy_kv import exit_distribution


def test_hidden_store_new_rows_do_not_grow_slots():
    store = HiddenStore(2, 8, torch.float32, torch.device("cpu"))
    for rows in range(1, 13):  # one new sequence at a time, each 10 tokens long (the reproduction's pattern)
        store.reserve(rows, 10)
    for buf in store.bufs:
        assert buf.shape[1] == 16, "a new row must not double the slot dimension"
        assert 12 <= buf.shape[0] <= 24
    store.reserve(3, 100)
    assert all(b.shape[1] >= 100 and b.shape[0] <= 24 for b in store.bufs)


def test_caps_stop_doubling_at_the_configured_bound():
    store = HiddenStore(1, 4, torch.float32, torch.device("cpu"))
    store.max_rows, store.max_slots = 5, 40
    store.reserve(5, 30)
    assert tuple(store.bufs[0].shape[:2]) == (5, 32)
    store.reserve(5, 33)
    assert tuple(store.bufs[0].shape[:2]) == (5, 40)  # doubling stops at the cap
    store.reserve(5, 50)
    assert tuple(store.bufs[0].shape[:2]) == (5, 50)  # a need past the cap is still met (never a wrong result)
    cache = SlotKVCache(2, 1, 4, torch.float32, rows=1, slots=16)
    cache.max_rows, cache.max_slots = 3, 20
    cache.reserve(2, 17)
    assert (cache.num_rows, cache.num_slots) == (2, 20)
    cache.reserve(3, 20)
    assert (cache.num_rows, cache.num_slots) == (3, 20)


def test_drafter_memory_stays_flat_when_sequences_are_never_released():
    """Today's bug: every new row doubled the hidden store's slots (a replica that never sees releases grew ~2^n)."""
    target = tiny_target(seed=5)
    drafter = SortedDrafter(noisy_draft(target))
    params = SamplingParams()
    for i, prompt in enumerate(random_prompts(12, seed=3, lo=6, hi=10)):
        drafter.propose([DraftRequest(f"s{i}", prompt, 2, params)])
    slots = {b.shape[1] for b in drafter.hidden.bufs}
    assert max(slots) <= 64, slots
    assert drafter.hidden.nbytes() <= 2 * 12 * 64 * 64 * 8 * len(drafter.hidden.bufs)


def test_capped_drafter_reclaims_lru_rows_and_stays_exact():
    target = tiny_target(seed=2)
    draft = noisy_draft(target, thresholds=[0.05, 0.03, 0.0])
    drafter = SortedDrafter(draft)
    limit_rows(drafter, 3, 64)
    params = SamplingParams(temperature=1.0, seed=0)
    seqs = {f"s{i}": p for i, p in enumerate(random_prompts(5, seed=4))}
    for round_ in range(4):
        for pair in (["s0", "s1"], ["s2", "s3"], ["s4", "s0"]):  # 5 live sequences take turns on 3 rows
            reqs = [DraftRequest(s, seqs[s], 3, params) for s in pair]
            for req, prop in zip(reqs, drafter.propose(reqs)):
                ctx = list(req.tokens)
                for tok, q, e in zip(prop.tokens, prop.q, prop.exits):
                    assert torch.allclose(q, exit_distribution(draft, ctx, e), atol=1e-10), (round_, req.seq_id)
                    ctx.append(tok)
                seqs[req.seq_id] = req.tokens + prop.tokens[:1] + [7]
    assert len(drafter.table) <= 3 and drafter.table.num_evicted > 0
    assert drafter.cache.num_rows <= 3 and all(b.shape[0] <= 3 for b in drafter.hidden.bufs)


def test_capped_verifier_equals_uncapped_and_refuses_oversized_batches():
    target = tiny_target(seed=1)
    capped, free = TargetVerifier(target), TargetVerifier(target)
    limit_rows(capped, 2, 64)
    seqs = {f"s{i}": p for i, p in enumerate(random_prompts(4, seed=6))}
    for round_ in range(3):
        for pair in (["s0", "s1"], ["s2", "s3"], ["s1", "s2"]):
            reqs = [ScoreRequest(s, seqs[s], 2) for s in pair]
            for a, b in zip(capped.score(reqs), free.score(reqs)):
                assert torch.allclose(a, b, atol=1e-10), round_
            for s in pair:
                seqs[s] = seqs[s] + [(len(seqs[s]) * 7) % 90 + 3]
    assert capped.cache.num_rows == 2 and capped.table.num_evicted > 0
    before = dict(capped.table.states)
    with pytest.raises(CapacityError, match="at most 2"):
        capped.score([ScoreRequest(s, seqs[s], 1) for s in ["s0", "s1", "s3"]])
    assert capped.table.states == before


def test_cached_prefix_reports_what_a_replica_holds():
    target = tiny_target(seed=1)
    verifier = TargetVerifier(target)
    prompt = random_prompts(1, seed=2, lo=8, hi=9)[0]
    assert verifier.table.cached_prefix("a", prompt) == 0
    verifier.score([ScoreRequest("a", prompt, 1)])
    assert verifier.table.cached_prefix("a", prompt + [5]) == len(prompt)
    assert verifier.table.cached_prefix("a", prompt[:3] + [0, 0]) == 3


def test_a_draft_on_a_base_of_its_own_keeps_only_its_layers(tiny_llama_dir, tmp_path):
    """The draft deployment loads the draft's base for its embedding, norm and head: once the draft is loaded, the
    base model and its layers past the draft's are unreferenced and freed (a 7B family's draft replica would
    otherwise hold the whole 7B), and the draft proposes what a draft loaded beside a live base does."""
    import gc
    import weakref

    from s2d_ray.core.draft import SortedDraft
    from s2d_ray.kernels import CpuKernels
    from s2d_ray.models import load_model
    from s2d_ray.models.drafts import load_draft, save_draft

    base = load_model(str(tiny_llama_dir))
    assert len(base.model.model.layers) == 2
    save_draft(SortedDraft.cut(base.model, str(tiny_llama_dir), 1, [1], [0.0], copy_layers=True), tmp_path / "d")
    fresh = load_model(str(tiny_llama_dir))
    unused, whole = weakref.ref(fresh.model.model.layers[1]), weakref.ref(fresh.model)
    draft = load_draft(tmp_path / "d", fresh.model, CpuKernels())  # as the draft replica builds it
    del fresh
    gc.collect()
    assert unused() is None and whole() is None
    assert len(draft.parts.layers) == len(draft.layers) == 1

    beside = load_draft(tmp_path / "d", base.model, CpuKernels())  # the base still alive (it is the engine's target)
    assert len(base.model.model.layers) == 2  # the target keeps its own layers
    prompt = list(range(3, 20))
    got = [SortedDrafter(d).propose([DraftRequest("s", prompt, 4, SamplingParams())])[0].tokens
           for d in (draft, beside)]
    assert got[0] == got[1] and len(got[0]) == 4


def test_memory_freed_among_live_tensors_goes_back_to_the_os():
    """What a replica does once loaded (replica.return_freed_memory): pages freed between tensors still alive (a
    dropped base model's layers, dtype copies) leave the process's RSS. Without it glibc keeps them (the RSS a memory
    limit sees)."""
    from s2d_ray.serve.replica import return_freed_memory

    return_freed_memory()
    chunks = [torch.ones(16 * 1024) for _ in range(4000)]  # 64 KiB each: malloc's heap, not mmap
    kept = chunks[::2]
    del chunks  # half of ~250 MiB freed, in holes between live tensors: glibc cannot shrink its heap by itself
    assert return_freed_memory() > 64 * 2**20
    assert return_freed_memory() < 16 * 2**20  # nothing left to hand back
    assert len(kept) == 2000 and float(kept[-1][0]) == 1.0
