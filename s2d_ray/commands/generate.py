"""`s2d generate`: speculative (or plain) generation from the command line, one JSON object per prompt."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..build import build_engine
from ..config import SamplingConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..prompts import encode_prompt, read_prompt_file
from ..token_bytes import token_bytes_fn
from .engine_args import add_engine_args, add_logits_args, check_logits_args, engine_config, logits_processors


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with S2D speculative decoding")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="one prompt per line, or JSONL with a `prompt` field")
    p.add_argument("--chat", action="store_true", help="apply the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: the target's logprob of each generated token and its top-N alternatives")
    add_logits_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Results go to stdout and nothing else does: whatever a library prints while models load or convert (DeepSpeed
    binds its log handler to the stdout of the moment it is imported) goes to stderr, so `--json` stays JSON lines."""
    results = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _generate(args, results)


def request(args: argparse.Namespace, seq_id: str, ids: list[int], tok, params: SamplingParams,
            eos: tuple[int, ...], grammar) -> GenerationRequest:
    """One prompt's request: its own processors (a grammar matcher follows one sequence)."""
    stops, processors = logits_processors(args, tok, len(ids), eos, grammar)
    extra = {"processors": processors} if processors else {}
    return GenerationRequest(seq_id, ids, args.max_new_tokens, params, stops, logprobs=args.logprobs, **extra)


def _generate(args: argparse.Namespace, results) -> int:
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    if args.logprobs is not None and (args.logprobs < 0 or not args.json):
        raise ValueError("--logprobs needs --json and a value >= 0")
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    cfg = engine_config(args)
    grammar = check_logits_args(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompt_file)
    built = build_engine(cfg)
    tok = built.target.tokenizer
    token_bytes = token_bytes_fn(tok)
    params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
    eos = tuple(i for i in {tok.eos_token_id} if i is not None)
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        reqs = [request(args, f"p{start + i}", encode_prompt(tok, text, args.chat), tok, params, eos, grammar)
                for i, text in enumerate(chunk)]
        for text, res in zip(chunk, built.engine.generate(reqs)):
            out = tok.decode(res.token_ids, skip_special_tokens=True)
            if args.json:
                row = {"prompt": text, "text": out, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                       "metrics": {**res.metrics, **built.engine.verifier.prefix_cache_stats(),  # caches: so far
                                   **(built.engine.suffix.stats() if built.engine.suffix is not None else {})}}
                if res.logprobs is not None:
                    row["logprobs"] = [{"token_id": e.token, "token": tok.decode([e.token]),
                                        "bytes": token_bytes(e.token), "logprob": e.logprob,
                                        "top": [[i, max(v, -9999.0)] for i, v in e.top]} for e in res.logprobs]
                print(json.dumps(row), file=results, flush=True)
            else:
                print(out, file=results, flush=True)
                m = res.metrics
                sys.stderr.write(f"[{m['num_generated_tokens']} tokens, {m['tokens_per_second']:.1f} tok/s, "
                                 f"mean accepted {m['mean_acceptance_length']:.2f}, exits {m['exit_histogram']}]\n")
    return 0

