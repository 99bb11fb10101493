"""Real SmolLM2-135M-Instruct (fp32): S2D greedy with penalties, logit_bias, min_tokens and bad_words on (a chain and a
tree with lookup) equals an independent greedy loop over transformers' own logits processors, token for token,
except at fp32 near-ties of the processed logits (detected and reported, as in test_real_smollm2)."""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.penalties import PenaltySpec, penalty_processors
from s2d_ray.core.policy import HeuristicK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.prompts import encode_prompt
from test_real_smollm2 import KERNELS, NEAR_TIE

pytestmark = pytest.mark.real

# Prompt -> the specs run on it: the first answer ends early (min_tokens holds its eos back), the second repeats
# tokens (the penalties bite).
PROMPTS = {"What is the capital of France?": ("logit_bias", "min_tokens", "bad_words", "all"),
           "Count from 1 to 5.": ("repetition", "frequency_presence", "all")}
N = 24


class FrequencyPresence:
    """OpenAI's formula written against transformers' processor interface (transformers has none)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        gen = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def hf_processors(spec: PenaltySpec, prompt_len: int, eos: int) -> LogitsProcessorList:
    """transformers' processors for `spec`, in the order s2d applies them (vLLM's)."""
    out = LogitsProcessorList()
    if spec.bad_words:
        out.append(NoBadWordsLogitsProcessor([list(w) for w in spec.bad_words]))
    if spec.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, spec.min_tokens, eos))
    if spec.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in spec.logit_bias]))
    if spec.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(spec.repetition_penalty))
    if spec.frequency_penalty or spec.presence_penalty:
        out.append(FrequencyPresence(prompt_len, spec.frequency_penalty, spec.presence_penalty))
    return out


def hf_greedy(model, prompt: list[int], procs: LogitsProcessorList, eos: int) -> list[int]:
    """An incremental greedy loop (transformers' KV cache) that stops at eos or N tokens."""
    ids = torch.tensor([prompt])
    past, step = None, ids
    with torch.no_grad():
        for _ in range(N):
            out = model(input_ids=step, cache=past, use_cache=True)
            past = out.cache
            nxt = procs(ids, out.logits[:, -1].float()).argmax(-1, keepdim=True)
            ids, step = torch.cat([ids, nxt], 1), nxt
            if int(nxt) == eos:
                break
    return ids[0, len(prompt):].tolist()


def specs(plain: list[int]) -> dict[str, PenaltySpec]:
    """Specs that change a prompt's unprocessed output `plain`."""
    return {"repetition": PenaltySpec(repetition_penalty=1.5),
            "frequency_presence": PenaltySpec(frequency_penalty=1.0, presence_penalty=1.0),
            "logit_bias": PenaltySpec(logit_bias=((plain[1], -100.0), (plain[4], 3.0))),
            "min_tokens": PenaltySpec(min_tokens=len(plain) + 6),
            "bad_words": PenaltySpec(bad_words=((plain[0],), (plain[2], plain[3]))),
            "all": PenaltySpec(0.4, 0.3, 1.2, ((plain[1], -5.0),), len(plain) + 3, ((plain[2], plain[3]),))}


def assert_same_or_near_tie(model, prompt, procs, ref, out):
    if ref == out:
        return
    i = next(j for j in range(min(len(ref), len(out))) if ref[j] != out[j])
    ids = torch.tensor([prompt + ref[:i]])
    with torch.no_grad():
        top = procs(ids, model(ids).logits[:, -1]).topk(2).values[0]
    gap = float(top[0] - top[1])
    print(f"divergence at token {i}: processed top-2 logit gap {gap:.2e}")
    assert gap < NEAR_TIE, f"output differs at token {i} where the processed top-2 gap is {gap:.3g}: a real bug"


def test_processed_s2d_equals_transformers_processors(smollm2):
    """The draft is the target's own layers (exits 10, 20, 30): it proposes the UNPROCESSED target's choices, so the
    processors are what rejects its tokens."""
    torch.set_num_threads(2)
    tok, model = smollm2.tokenizer, smollm2.model
    eos = tok.eos_token_id
    cases = []
    for i, (text, names) in enumerate(PROMPTS.items()):
        prompt = encode_prompt(tok, text, chat=True)
        plain = hf_greedy(model, prompt, LogitsProcessorList(), eos)
        if i == 0:
            assert plain[-1] == eos and len(plain) < N - 8  # so min_tokens holds eos back
        for name in names:
            spec = specs(plain)[name]
            hf = hf_processors(spec, len(prompt), eos)
            ref = hf_greedy(model, prompt, hf, eos)
            assert ref != plain, name  # the processor changes the output
            req = GenerationRequest(f"{name}-{i}", prompt, N, stop_token_ids=(eos,),
                                    processors=penalty_processors(spec, len(prompt), (eos,)))
            cases.append((req, hf, ref))
    draft = SortedDraft.cut(model, "smollm2-self", 30, [10, 20, 30], [0.9, 0.9, 0.0], kernels=KERNELS)
    tree = TreeDrafter(SortedDrafter(draft), PromptLookup(3, 6, candidates=2), alone_ngram=3)
    engines = {"chain": SpecEngine(TargetVerifier(model, kernels=KERNELS), SortedDrafter(draft), HeuristicK()),
               "tree+lookup": SpecEngine(TargetVerifier(model, kernels=KERNELS), tree, HeuristicK(),
                                         budget=SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=12),
                                                                  None, max_depth=6))}
    for mode, engine in engines.items():
        out = engine.generate([req for req, _, _ in cases])
        for (req, hf, ref), res in zip(cases, out):
            assert_same_or_near_tie(model, req.prompt_ids, hf, ref, res.token_ids)
        assert sum(r.metrics["num_accepted_draft_tokens"] for r in out) > 0, mode
