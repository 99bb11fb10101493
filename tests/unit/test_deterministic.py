"""Deterministic mode (kernels/deterministic.py): every position's logits in any pass (a chain, a token tree, a batch
of sequences, a whole prompt) equal a one-token decode step's bit for bit, in bf16 and fp32; so greedy S2D equals
plain greedy decoding token for token at batch 1 and 8. The negative control injects a one-ulp batch dependence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from core_fixtures import noisy_draft, random_prompts
from helpers import make_tiny_llama
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.tree import TokenTree
from s2d_ray.core.types import ScoreRequest
from s2d_ray.kernels import CpuKernels, DeterministicKernels
from s2d_ray.kernels.deterministic import CALL_ROWS, CHUNK_ROWS, RowChunkedLinear, call_plan, invariant_call_rows
from s2d_ray.kernels.linear import supported

DET = DeterministicKernels()
DTYPES = [torch.bfloat16, torch.float32]
VOCAB = 96


@pytest.fixture(scope="module", params=DTYPES, ids=["bf16", "fp32"])
def target(request) -> nn.Module:
    """A tiny random Llama (hidden 64, GQA 4/2, an MLP of 128 so the down projection reduces over more than 64)
    whose logits are peaky enough that drafts are accepted and rejected."""
    model = make_tiny_llama(vocab_size=VOCAB, num_layers=3, seed=0, dtype=torch.float32, hidden_size=64)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    return model.to(request.param)


def decode_logits(verifier: TargetVerifier, seq_id: str, tokens: list[int], first: int) -> torch.Tensor:
    """Logits at positions first-1 .. len-1 of `tokens`, each from a one-token decode step (prompt tokens[:first])."""
    out = [verifier.score([ScoreRequest(seq_id, tokens[:n], 1)])[0][0] for n in range(first, len(tokens) + 1)]
    return torch.stack(out)


def random_tree(n: int, gen: torch.Generator) -> TokenTree:
    tree = TokenTree()
    while len(tree) < n:
        tree.add(int(torch.randint(-1, len(tree), (1,), generator=gen)), int(torch.randint(3, VOCAB, (1,),
                                                                                          generator=gen)), 1, 0.5)
    return tree


def path_tokens(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def mismatches(target: nn.Module, kernels) -> list[str]:
    """Every case where a verify pass's logits differ from decode steps' (bitwise), over one mixed batch: chains of
    several widths, token trees, a row prefilled with its draft in one pass, rows at different lengths."""
    gen = torch.Generator().manual_seed(1)
    prompts = random_prompts(6, vocab_size=VOCAB, seed=2, lo=4, hi=30)
    extra = [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in (1, 3, 5, 8, 12, 2)]
    trees = {2: random_tree(7, gen), 4: random_tree(11, gen)}
    verify, decode = TargetVerifier(target, kernels=kernels), TargetVerifier(target, kernels=kernels)
    for i, p in enumerate(prompts[:-1]):  # the last row arrives new: its prompt and draft in one pass
        verify.score([ScoreRequest(f"s{i}", p, 1)])
    reqs = [ScoreRequest(f"s{i}", p + trees[i].tokens, len(trees[i]) + 1, trees[i].parents) if i in trees
            else ScoreRequest(f"s{i}", p + e, len(e) + 1) for i, (p, e) in enumerate(zip(prompts, extra))]
    bad = []
    for i, logits in enumerate(verify.score(reqs)):
        p = prompts[i]
        if i in trees:
            paths = [[]] + [path_tokens(trees[i], n) for n in range(len(trees[i]))]
            want = torch.stack([decode_logits(decode, f"t{i}.{n}", p + path, len(p))[-1]
                                for n, path in enumerate(paths)])
        else:
            want = decode_logits(decode, f"c{i}", p + extra[i], len(p))
        bad += [f"row {i} logit {j}" for j in range(len(want)) if not torch.equal(logits[j], want[j])]
    return bad


def test_verify_logits_equal_decode_steps_bitwise(target):
    assert mismatches(target, DET) == []


def test_whole_prompt_pass_equals_decoding_it_token_by_token(target):
    """Prompt logprobs (every position's logits in one prefill, in chunks) equal decoding the prompt one by one."""
    prompt = random_prompts(1, vocab_size=VOCAB, seed=5, lo=40, hi=41)[0]
    chunked = TargetVerifier(target, kernels=DET, prefill_chunk=16)
    logits = chunked.score([ScoreRequest("a", prompt, len(prompt))])[0]
    assert torch.equal(logits, decode_logits(TargetVerifier(target, kernels=DET), "b", prompt, 1))


class OneUlpWhenBatched(DeterministicKernels):
    """A wrong backend: the LM head moves the first row's first logit by one ulp whenever a call holds several rows
    (a batch dependence as small as bf16 rounding can make)."""

    def projections(self, module: nn.Module) -> nn.Module:
        out = super().projections(module)
        if isinstance(out, RowChunkedLinear) and out.out_features == VOCAB:
            return PerturbedHead(out.weight)
        return out


class PerturbedHead(RowChunkedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if x.numel() // x.shape[-1] > 1:
            out = out.clone()
            flat = out.view(-1, out.shape[-1])
            flat[0, 0] = torch.nextafter(flat[0, 0], torch.tensor(float("inf"), dtype=flat.dtype))
        return out


def test_negative_control_one_ulp_batch_dependence_is_caught(target):
    assert mismatches(target, OneUlpWhenBatched())


def test_default_kernels_are_not_batch_invariant_here():
    """Why the mode exists: the default backend's verify logits part from decode steps' somewhere (fp32, where
    torch's GEMM picks another kernel for several rows). Skipped on a CPU whose stock kernels happen to agree."""
    model = make_tiny_llama(vocab_size=VOCAB, num_layers=3, seed=0, dtype=torch.float32, hidden_size=64)
    bad = mismatches(model, CpuKernels(linear="stock"))
    if not bad:
        pytest.skip("this CPU's stock kernels are batch-invariant at these shapes")
    assert bad


def test_row_chunked_linear_is_row_invariant():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        w = torch.randn(40, 96, generator=gen).to(dtype)
        x = torch.randn(2 * CHUNK_ROWS + 3, 96, generator=gen).to(dtype)
        lin = RowChunkedLinear(w)
        assert lin.reordered == (dtype != torch.float64 and supported(dtype))  # the reordered copy where oneDNN runs
        rows = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(lin(x), rows)
        assert torch.equal(lin(x.view(1, -1, 96))[0], rows)
        assert torch.allclose(lin(x).float(), (x.float() @ w.float().T), atol=0.1)


def test_larger_calls_are_row_invariant_and_only_where_probed():
    """A pass of many rows runs as a few larger calls (those the probe confirmed here), every row still equal to
    itself alone; a row count is split into the confirmed sizes, CHUNK_ROWS always among them."""
    assert call_plan(104, CALL_ROWS) == [64, 32, 8] and call_plan(104, (CHUNK_ROWS,)) == [8] * 13
    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        w = torch.randn(48, 96, generator=gen).to(dtype)
        sizes = invariant_call_rows(48, 96, dtype, torch.get_num_threads(), False)
        assert CHUNK_ROWS in sizes and set(sizes) <= set(CALL_ROWS)
        x = torch.randn(101, 96, generator=gen).to(dtype)
        lin = RowChunkedLinear(w)
        rows = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(lin(x), rows)


def greedy(engine: SpecEngine, prompts: list[list[int]], n: int, batch: bool, drafted: list | None = None):
    """Token ids per prompt; `drafted` collects (draft tokens, accepted ones) per output."""
    reqs = [GenerationRequest(f"s{i}", p, n) for i, p in enumerate(prompts)]
    out = engine.generate(reqs) if batch else [engine.generate([r])[0] for r in reqs]
    if drafted is not None:
        drafted += [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_draft_tokens"]) for o in out]
    return [o.token_ids for o in out]


def spec_engines(target: nn.Module) -> dict[str, SpecEngine]:
    """S2D with chains (the draft on the default kernels: it needs no determinism) and with token trees plus prompt
    lookup branches, both verified in the mode."""
    draft = noisy_draft(target, num_layers=2, noise=0.06)
    chain = SpecEngine(TargetVerifier(target, kernels=DET), SortedDrafter(draft), FixedK(4))
    trees = TreeDrafter(SortedDrafter(draft), PromptLookup(max_ngram=3, num_tokens=6))
    shape = TreeShape(width=2, lookup=True, max_nodes=12)
    tree = SpecEngine(TargetVerifier(target, kernels=DET), trees, FixedK(4), budget=SpeculationBudget(shape, None, 5))
    return {"chain": chain, "tree": tree}


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_s2d_equals_plain_greedy_in_the_mode(target, batch):
    prompts = random_prompts(max(batch, 4), vocab_size=VOCAB, seed=10 + batch, lo=4, hi=24)  # batch 1: one by one
    plain = greedy(SpecEngine(TargetVerifier(target, kernels=DET)), prompts, 32, batch=batch > 1)
    if batch > 1:  # plain decoding itself does not depend on the batch in the mode
        assert plain == greedy(SpecEngine(TargetVerifier(target, kernels=DET)), prompts, 32, batch=False)
    for name, engine in spec_engines(target).items():
        drafted: list[tuple[int, int]] = []
        out = greedy(engine, prompts, 32, batch=batch > 1, drafted=drafted)
        assert out == plain, name
        # Both branches exercised: accepted and rejected draft tokens, or equality proves little.
        assert 0 < sum(a for _, a in drafted) < sum(d for d, _ in drafted), name
        assert out == greedy(engine, prompts, 32, batch=batch > 1), f"{name}: a repeat differs"


def test_the_flag_selects_the_deterministic_kernels_for_the_target_only():
    import argparse

    from s2d_ray.build import make_kernels
    from s2d_ray.commands.engine_args import add_engine_args, engine_config
    from s2d_ray.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args(["--deterministic"]))
    assert cfg.deterministic and isinstance(make_kernels(cfg), DeterministicKernels)
    assert not isinstance(make_kernels(EngineConfig()), DeterministicKernels)
    from s2d_ray.serve.app_config import AppConfig

    app = {"targets": [{"name": "t", "source": "smollm2-135m-instruct", "dtype": "float32"}], "deterministic": True}
    assert AppConfig.model_validate(app).engine_config("t").deterministic
    app["targets"][0]["tp_size"] = 2  # not covered: refused, never silently non-deterministic
    with pytest.raises(ValueError, match="tensor-parallel"):
        AppConfig.model_validate(app)


def test_the_mode_is_refused_off_the_cpu():
    """On CUDA norms and reductions are not batch-invariant yet: the mode refuses to build there, naming the field."""
    from s2d_ray.build import build_verifier, check_deterministic_device
    from s2d_ray.config import EngineConfig
    from s2d_ray.errors import ConfigError

    cfg = EngineConfig(deterministic=True)
    with pytest.raises(ConfigError, match="deterministic: true runs on the CPU only"):
        check_deterministic_device(cfg, "cuda")
    check_deterministic_device(cfg, "cpu")
    check_deterministic_device(EngineConfig(), "cuda")  # the control: the default kernels are not refused
    with pytest.raises(ConfigError, match="deterministic"):  # a model that is not on the CPU
        build_verifier(make_tiny_llama().to("meta"), cfg)
    from s2d_ray.serve.app_config import AppConfig

    app = {"targets": [{"name": "t", "source": "smollm2-135m-instruct", "num_gpus": 1}], "deterministic": True}
    with pytest.raises(ValueError, match="CPU only"):  # the served app refuses it when the config is read
        AppConfig.model_validate(app)
    app["deterministic"] = False
    AppConfig.model_validate(app)  # the control


def attention_case(layout: str, dtype: torch.dtype, gen: torch.Generator):
    """Rows of different lengths (prompts, a chain, a token tree) over a cache stored as `layout`: heads outer as a
    view of a longer buffer, or heads inner ([b, k, kvh, d] transposed), as caches hand them over."""
    b, kvh, g, d, q, k = 3, 2, 2, 16, 6, 70
    buffer = torch.randn(2, b, kvh, 96, d, generator=gen).to(dtype)
    if layout == "heads inner":
        buffer = torch.randn(2, b, 96, kvh, d, generator=gen).to(dtype).transpose(2, 3)
    key, value = buffer[0, :, :, :k], buffer[1, :, :, :k]
    query = torch.randn(b, kvh * g, q, d, generator=gen).to(dtype)
    mask = torch.zeros(b, 1, q, k, dtype=torch.bool)
    for i, n in enumerate((9, 33, 61)):
        mask[i, 0, :, :n] = True
        for j in range(q):
            mask[i, 0, j, n + j] = True
            if i == 2 and j:  # a tree: node j's parent is (j - 1) // 2
                mask[i, 0, j, n + (j - 1) // 2] = True
            elif j:
                mask[i, 0, j, n: n + j] = True
    return query, key, value, mask


def rows_unlike_alone(kernel, query, key, value, mask) -> int:
    """How many query rows of one mixed pass differ (bitwise) from the row computed alone over exactly its own keys,
    compacted in slot order: what a decode step at that position reads."""
    out, bad = kernel(query, key, value, mask, 0.25), 0
    for i in range(query.shape[0]):
        for j in range(query.shape[2]):
            keep = mask[i, 0, j]
            alone = kernel(query[i:i + 1, :, j:j + 1], key[i:i + 1, :, keep], value[i:i + 1, :, keep], None, 0.25)
            bad += not torch.equal(out[i, j], alone[0, 0])
    return bad


def wide_attention(query, key, value, mask, scale):
    """A wrong kernel for the mode: one masked softmax over the pass's whole key range."""
    rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                          mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("layout", ["heads outer", "heads inner"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_each_attention_row_equals_itself_alone(layout, dtype):
    """per_query_attention over a whole mixed pass (prompt rows, a chain, a tree; a cache view with heads outer or
    inner) equals every row computed alone over its own keys, and stays close to plain masked attention; the
    negative control, a masked softmax over the pass's width, parts somewhere."""
    from s2d_ray.kernels.deterministic import per_query_attention

    case = attention_case(layout, dtype, torch.Generator().manual_seed(3))
    assert rows_unlike_alone(per_query_attention, *case) == 0
    assert rows_unlike_alone(wide_attention, *case) > 0
    out, want = per_query_attention(*case, 0.25).float(), wide_attention(*(t.float() for t in case[:3]), case[3], 0.25)
    assert torch.allclose(out, want, atol=0.05 if dtype == torch.bfloat16 else 1e-5)
