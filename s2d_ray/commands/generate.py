"""`s2d generate`: speculative (or plain) generation from the command line, one JSON object per prompt."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..build import build_engine
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, DraftConfig, EngineConfig, SamplingConfig, SpecConfig, TargetConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..prompts import encode_prompt, read_prompt_file


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Arguments every engine-building command shares (generate, bench, calibrate)."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="target: named source, HF directory or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft directory, committed draft name or cut:<model>:<L>")
    p.add_argument("--mode", default="s2d",
                   help="s2d (adaptive exits) | ar (target only) | lookup (prompt lookup alone) | exit:<layer>")
    add_spec_args(p)
    p.add_argument("--exits", type=_int_list, default=None, help="override exits, e.g. 2,4,6")
    p.add_argument("--thresholds", type=_float_list, default=None, help="override thresholds, e.g. 0.5,0.5,0")
    p.add_argument("--stop-confidence", type=float, default=0.0,
                   help="stop drafting when the draft's probability of its token falls below this")
    p.add_argument("--calibration", default="auto",
                   help="per-target profile from `s2d calibrate`; auto: the draft's committed one; off: none")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculation shape flags; unset ones come from the calibration profile, then SpecConfig's defaults."""
    p.add_argument("--policy", choices=["heuristic", "fixed", "auto"], default=None,
                   help="draft length policy: auto = cost-based and load-aware (default: the profile's)")
    p.add_argument("--k", type=int, default=None,
                   help="fixed k, or the heuristic's starting k (default: the profile's, else 5)")
    p.add_argument("--width", type=int, default=None, help="token tree: draft candidates per depth (1 = chain)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="add prompt-lookup candidates to the tree")
    p.add_argument("--max-nodes", type=int, default=None, help="most tree nodes verified per sequence and round")


SPEC_FLAGS = ("policy", "k", "width", "lookup", "max_nodes")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        target=TargetConfig(name=args.target, dtype=args.dtype, calibration=args.calibration),
        draft=DraftConfig(source=args.draft, exit_layers=args.exits, thresholds=args.thresholds,
                          stop_confidence=args.stop_confidence),
        spec=spec_config(args, args.mode),
        num_threads=args.threads,
    )


def spec_config(args: argparse.Namespace, mode: str) -> SpecConfig:
    """Only what the user gave is set, so a calibration profile can fill in the draft-length policy."""
    given = {f: getattr(args, f, None) for f in SPEC_FLAGS}
    return SpecConfig(mode=mode, **{f: v for f, v in given.items() if v is not None})


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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    cfg = engine_config(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompt_file)
    built = build_engine(cfg)
    tok = built.target.tokenizer
    params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
    eos = tuple(i for i in {tok.eos_token_id} if i is not None)
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        reqs = [GenerationRequest(f"p{start + i}", encode_prompt(tok, text, args.chat), args.max_new_tokens, params, eos)
                for i, text in enumerate(chunk)]
        for text, res in zip(chunk, built.engine.generate(reqs)):
            out = tok.decode(res.token_ids, skip_special_tokens=True)
            if args.json:
                print(json.dumps({"prompt": text, "text": out, "token_ids": res.token_ids,
                                  "finish_reason": res.finish_reason, "metrics": res.metrics}), flush=True)
            else:
                print(out, flush=True)
                m = res.metrics
                sys.stderr.write(f"[{m['num_generated_tokens']} tokens, {m['tokens_per_second']:.1f} tok/s, "
                                 f"mean accepted {m['mean_acceptance_length']:.2f}, exits {m['exit_histogram']}]\n")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
