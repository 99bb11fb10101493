"""Real SmolLM2-135M-Instruct in bf16, deterministic mode: greedy S2D (the committed sorted draft, token trees as
shipped) equals plain greedy decoding token for token, one prompt at a time. By default bf16 S2D parts from plain
decoding at near-ties; in the mode every verified position is computed as a decode step would compute it, on one
intra-op thread count (THREADS) for every pass of the target: prompts, trees and decode steps alike. (The draft
keeps the default backend, build.py `draft_kernels`: the target decides every token.)"""

from __future__ import annotations

import pytest
import torch

from s2d_ray.build import build_engine, load_target
from s2d_ray.config import EngineConfig, SpecConfig, TargetConfig
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.models.model_cache import default_cache_dir
from s2d_ray.prompts import encode_prompt

pytestmark = pytest.mark.real

PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for writing clean Python code.",
    "What happens when water freezes?",
]


THREADS = 2  # the mode's pinned count; the test process itself runs on 1 (tests/conftest.py)


def config(mode: str) -> EngineConfig:
    return EngineConfig(target=TargetConfig(name="smollm2-135m-instruct", dtype="bfloat16"),
                        spec=SpecConfig(mode=mode), deterministic=True, num_threads=THREADS)


def spy_threads(stack) -> list[tuple[int, int]]:
    """(positions, intra-op threads) of every pass through `stack`'s layers (its layer modules may be swapped for
    the backend's projections after load, so the spy wraps the stack's own call)."""
    seen: list[tuple[int, int]] = []
    run_layers = stack.run_layers

    def spied(seg, x, *args, **kwargs):
        seen.append((x.shape[0] * x.shape[1], torch.get_num_threads()))
        return run_layers(seg, x, *args, **kwargs)

    stack.run_layers = spied
    return seen


@pytest.fixture(scope="module")
def bf16_target():
    if not (default_cache_dir() / "models" / "smollm2-135m-instruct").is_dir():
        pytest.skip("SmolLM2-135M-Instruct is not converted on this machine (run `s2d generate` once)")
    return load_target(config("ar"))


def test_deterministic_bf16_s2d_equals_plain_greedy(bf16_target):
    tok = bf16_target.tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    outputs, spies = {}, []
    for mode in ("ar", "s2d"):
        torch.set_num_threads(1)  # not the mode's count: the backend must set it for every pass
        engine = build_engine(config(mode), target=bf16_target).engine
        spies.append(spy_threads(engine.verifier.stack))
        outputs[mode] = [engine.generate([GenerationRequest(f"{mode}{i}", p, 32)])[0] for i, p in enumerate(prompts)]
    torch.set_num_threads(1)
    for plain, spec in zip(outputs["ar"], outputs["s2d"]):
        assert spec.token_ids == plain.token_ids
    assert sum(s.metrics["num_accepted_draft_tokens"] for s in outputs["s2d"]) > 0  # speculation was exercised
    seen = [s for spy in spies for s in spy]
    assert len(spies) == 2 and all(spies)  # the plain target and S2D's target each ran passes
    # Every target pass ran on THREADS, wide (prompt, tree) and narrow (decode) ones alike; both kinds happened.
    assert {threads for _, threads in seen} == {THREADS}, [sorted(set(spy)) for spy in spies]
    assert max(n for n, _ in seen) > 8 and min(n for n, _ in seen) == 1
