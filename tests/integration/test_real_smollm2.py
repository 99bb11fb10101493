"""Real SmolLM2-135M-Instruct (fp32): greedy S2D equals target-only greedy, except at fp32 near-ties, which are
detected and reported by the target's top-2 logit gap at the first differing token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import HeuristicK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.kernels import CpuKernels
from s2d_ray.models.model_cache import default_cache_dir
from s2d_ray.prompts import encode_prompt

KERNELS = CpuKernels()  # the backend the shipped entry points inject

pytestmark = pytest.mark.real

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
NEAR_TIE = 1e-3  # fp32 logits from batched k+1-token verification vs 1-token steps differ by ~1e-5


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def assert_same_or_near_tie(model, prompt_ids, ref, out):
    if ref == out:
        return
    i = next(j for j in range(min(len(ref), len(out))) if ref[j] != out[j])
    gap = top2_gap(model, prompt_ids + ref[:i])
    print(f"divergence at token {i}: target top-2 logit gap {gap:.2e}")
    assert gap < NEAR_TIE, f"output differs at token {i} where the target's top-2 gap is {gap:.3g}: a real bug"


@pytest.fixture(scope="module")
def bf16_draft(smollm2):
    """A high-acceptance draft: all 30 layers of a bf16 copy (agrees ~0.98), exits at 10/20/30."""
    import copy

    twin = copy.deepcopy(smollm2.model).to(torch.bfloat16)
    return SortedDraft.cut(twin, "smollm2-bf16", 30, [10, 20, 30], [0.9, 0.9, 0.0], kernels=KERNELS)


def test_greedy_s2d_equals_target_on_real_weights(smollm2, bf16_draft):
    torch.set_num_threads(2)
    tok = smollm2.tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    eos = (tok.eos_token_id,)
    ar = SpecEngine(TargetVerifier(smollm2.model, kernels=KERNELS)).generate(
        [GenerationRequest(f"p{i}", p, 24, stop_token_ids=eos) for i, p in enumerate(prompts)])
    spec = SpecEngine(TargetVerifier(smollm2.model, kernels=KERNELS), SortedDrafter(bf16_draft), HeuristicK())
    out = spec.generate([GenerationRequest(f"p{i}", p, 24, stop_token_ids=eos) for i, p in enumerate(prompts)])
    for p, a, s in zip(prompts, ar, out):
        assert_same_or_near_tie(smollm2.model, p, a.token_ids, s.token_ids)
    assert sum(s.metrics["num_accepted_draft_tokens"] for s in out) > 0  # multi-token acceptance was exercised
    assert tok.decode(ar[0].token_ids, skip_special_tokens=True).strip()


def test_ar_mode_matches_transformers_generate(smollm2):
    torch.set_num_threads(2)
    tok = smollm2.tokenizer
    ids = encode_prompt(tok, PROMPTS[0], chat=True)
    ours = SpecEngine(TargetVerifier(smollm2.model, kernels=KERNELS)).generate([GenerationRequest("a", ids, 48)])[0].token_ids
    with torch.no_grad():
        # An explicit mask: the chat prompt contains <|im_end|>, which is also the pad id, and generate would
        # otherwise infer a mask that hides those prompt tokens.
        hf = smollm2.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=48, do_sample=False, eos_token_id=None,
                                    pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert_same_or_near_tie(smollm2.model, ids, hf, ours)


def test_logprobs_match_a_plain_forward_on_real_weights(smollm2, bf16_draft):
    """Served logprobs are the target's: S2D and target-only agree with log_softmax of one HF forward (fp32)."""
    torch.set_num_threads(2)
    tok = smollm2.tokenizer
    prompt = encode_prompt(tok, PROMPTS[0], chat=True)
    engines = {"ar": SpecEngine(TargetVerifier(smollm2.model, kernels=KERNELS)),
               "s2d": SpecEngine(TargetVerifier(smollm2.model, kernels=KERNELS), SortedDrafter(bf16_draft), HeuristicK())}
    for name, engine in engines.items():
        res = engine.generate([GenerationRequest(name, prompt, 16, logprobs=3, prompt_logprobs=True)])[0]
        with torch.no_grad():
            ref = smollm2.model(torch.tensor([prompt + res.token_ids])).logits[0, :-1].log_softmax(-1)
        got = [lp.logprob for lp in res.prompt_logprobs[1:]] + [lp.logprob for lp in res.logprobs]
        want = [float(ref[j, t]) for j, t in enumerate((prompt + res.token_ids)[1:])]
        assert got == pytest.approx(want, abs=1e-3), name
        if name == "s2d":
            assert res.metrics["num_accepted_draft_tokens"] > 0


def test_json_stdout_is_json_lines_when_the_run_first_converts_a_target(smollm2, tmp_path):
    """`s2d generate --json` on a cache that holds the base model but not the GSM8K target: the run merges the
    adapter first, and what libraries print meanwhile (DeepSpeed's accelerator warning among them) must reach stderr,
    never stdout."""
    cache = tmp_path / "cache"
    shutil.copytree(default_cache_dir() / "models" / "smollm2-135m-instruct", cache / "models" / "smollm2-135m-instruct")
    env = dict(os.environ, S2D_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-m", "s2d_ray.cli", "generate", "--target", "smollm2-135m-gsm8k", "--chat",
                          "--prompt", "What is 2 + 3?", "--max-new-tokens", "4", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (cache / "models" / "smollm2-135m-gsm8k").is_dir()  # the target was converted in this run
    rows = [json.loads(line) for line in run.stdout.splitlines()]  # every stdout line parses
    assert len(rows) == 1 and len(rows[0]["token_ids"]) == 4
