"""What leaves a deployment is on the CPU: the router (and a TP replica) hold no GPU, and a CUDA tensor would not
unpickle there. The answers of the target's and the draft's deployment-facing functions are checked with `off_host`,
whose negative control is a tensor on another device (`meta`, the one non-CPU device a CPU-only machine has)."""

from __future__ import annotations

import pickle

import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import DraftRequest, Proposal, SamplingParams, ScoreRequest
from s2d_ray.serve.draft_deployment import propose_rows
from s2d_ray.serve.replica import device_report, off_host, score_counted, to_host


def test_off_host_finds_a_tensor_on_another_device():
    """Negative control: the check the other tests rely on does see a non-CPU tensor, wherever it sits."""
    meta = torch.empty(3, 5, device="meta")
    assert off_host(torch.zeros(2)) == []
    assert off_host([torch.zeros(1), (meta,)]) == ["[1][0] on meta"]
    assert off_host({"q": meta}) == ["['q'] on meta"]
    assert off_host(Proposal(tokens=[1], q=meta, exits=[1])) == [".q on meta"]


def test_target_answers_are_cpu_tensors_of_their_own_storage():
    verifier = TargetVerifier(tiny_target(seed=3))
    prompts = random_prompts(3, seed=1)
    requests = [ScoreRequest(f"s{i}", p, 2, argmax_only=i == 0) for i, p in enumerate(prompts)]
    out, recomputed = score_counted(verifier, requests, [0, 0, 0])
    assert off_host(out) == [] and all(t.device.type == "cpu" for t in out)
    assert recomputed == [0, 0, 0]
    assert out[0].shape == (2,) and out[1].shape == (2, 96)
    # each answer pickles alone, not the storage of the batch's logits
    assert len(pickle.dumps(out[1])) < 2 * out[1].numel() * out[1].element_size() + 2048


def test_draft_proposals_leave_on_the_cpu():
    target = tiny_target(seed=4)
    drafter = SortedDrafter(noisy_draft(target))
    params = SamplingParams(temperature=1.0, seed=0)
    rows = [DraftRequest(f"s{i}", p, 3, params) for i, p in enumerate(random_prompts(3, seed=2))]
    proposals = propose_rows(drafter, rows, max_rows=2)  # two forwards
    assert len(proposals) == 3 and off_host(proposals) == []
    assert all(p.q is not None and p.q.device.type == "cpu" for p in proposals)


def test_to_host_keeps_fields_and_cpu_tensors_as_they_are():
    q = torch.rand(2, 4)
    prop = Proposal(tokens=[5, 6], q=q, exits=[1, 2], parents=None, scores=[0.5, 0.2])
    moved = to_host(prop)
    assert moved.q is q and moved.tokens == [5, 6] and moved.exits == [1, 2] and moved.scores == [0.5, 0.2]
    assert to_host((torch.ones(1), 3))[1] == 3


def test_device_report_names_device_and_dtype():
    assert device_report(tiny_target(seed=1)) == {"device": "cpu", "dtype": "float64"}
    assert device_report(None) == {"device": "cpu", "dtype": None}
