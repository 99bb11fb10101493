"""min_tokens holds stop strings back as vLLM does: a stop string counts only where it ends after the first
min_tokens generated tokens' text, in plain decoding, chains and trees alike, and in the served text (the router's
TextAssembler cuts by the same rule). Control: with min_tokens 0 the same stop string ends the output early."""

from __future__ import annotations

import pytest

from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from helpers import make_tiny_tokenizer
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier

N = 20


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(320)


def engines(target, detokenize):
    draft = noisy_draft(target)
    tree = SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=12), None, max_depth=6)
    return {
        "plain": SpecEngine(TargetVerifier(target, kernels=KERNELS), detokenize=detokenize),
        "chain": SpecEngine(TargetVerifier(target, kernels=KERNELS), SortedDrafter(draft), FixedK(4),
                            detokenize=detokenize),
        "tree": SpecEngine(TargetVerifier(target, kernels=KERNELS),
                           TreeDrafter(SortedDrafter(draft), PromptLookup(3, 4), alone_ngram=3), FixedK(3),
                           budget=tree, detokenize=detokenize),
    }


def expected_cut(decode, ids: list[int], stop: str, min_tokens: int) -> int | None:
    """The reference rule, written out: the fewest tokens whose text has `stop` ending after the first
    min_tokens tokens' text."""
    base = len(decode(ids[:min_tokens])) if min_tokens else 0
    for n in range(min_tokens + 1, len(ids) + 1):
        text = decode(ids[:n])
        if any(text.startswith(stop, i) and i + len(stop) > base for i in range(len(text))):
            return n
    return None


def words(ids: list[int]) -> str:
    """A detokenizer whose stop strings can span tokens: ids as space-separated numbers."""
    return " ".join(map(str, ids))


def test_stop_strings_wait_for_min_tokens_plain_chain_and_tree():
    target = tiny_target(seed=0)
    prompt = random_prompts(1, seed=3)[0]
    ref = engines(target, words)["plain"].generate([GenerationRequest("ref", prompt, N)])[0].token_ids
    head = len(words(ref[:1]))
    stop = words(ref)[head - 1: head + 2]  # token 0's last digit, the space, token 1's first digit
    min_tokens = 6
    first, late = expected_cut(words, ref, stop, 0), expected_cut(words, ref, stop, min_tokens)
    assert first is not None and late is not None and first <= min_tokens < late
    for name, engine in engines(target, words).items():
        for floor, cut in ((0, first), (min_tokens, late)):
            (res,) = engine.generate([GenerationRequest(f"{name}{floor}", prompt, N, stop_strings=(stop,),
                                                        min_tokens=floor)])
            assert res.token_ids == ref[:cut] and res.finish_reason == "stop", (name, floor)
            if name != "plain" and floor:
                assert res.metrics["num_accepted_draft_tokens"] > 0, name


def test_served_text_cuts_by_the_same_rule(tok):
    from s2d_ray.serve.app_config import Limits
    from s2d_ray.serve.openai_protocol import GenerateRequest
    from s2d_ray.serve.prepare import ModelInfo, TextAssembler, to_generation

    info = ModelInfo("m", tok, 256, (2,))
    ids = tok.encode("ab. cd. ef. gh")
    stop = "."
    text = tok.decode(ids)
    cut = expected_cut(tok.decode, ids, stop, 3)
    base_text = tok.decode(ids[:cut])
    assert TextAssembler(info, (stop,), ids).final_text() == "ab"  # control: min_tokens 0 cuts at the first
    want = base_text[: base_text.rfind(stop)]
    assert TextAssembler(info, (stop,), ids, min_tokens=3).final_text() == want and len(want) > 2
    assert text.startswith(want)
    gen = to_generation(info, GenerateRequest(model="m", prompt="hi", stop=[stop], min_tokens=3, max_tokens=8),
                        Limits())
    assert gen.min_tokens == 3 and gen.stop_strings == (stop,)
