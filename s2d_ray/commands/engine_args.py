"""The engine flags every engine-building command shares (generate, bench spec/steps, calibrate), defined once, and
the one comma-list argument type."""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar, get_args

from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, DType, DraftConfig, EngineConfig, SpecConfig, TargetConfig
from ..hardware import resolve_dtype

T = TypeVar("T")


def comma_list(convert: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """An argparse type for `a,b,c` (blank items dropped; at least one item)."""

    def parse(text: str) -> list[T]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            if items:
                return [convert(x) for x in items]
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")

    return parse


INTS = comma_list(int, "integers")
FLOATS = comma_list(float, "numbers")
NAMES = comma_list(str, "names")


def add_engine_args(p: argparse.ArgumentParser, multi_target: bool = False, mode: bool = True) -> None:
    """Target, draft, speculation and runtime flags; `multi_target`: --target repeats (bench spec); `mode`: whether
    the command takes --mode (the benchmarks pick modes per method themselves)."""
    if multi_target:
        p.add_argument("--target", action="append", default=None,
                       help=f"target (repeatable; one draft serves all); default {DEFAULT_TARGET}")
    else:
        p.add_argument("--target", default=DEFAULT_TARGET, help="target: named source, HF directory or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft directory, committed draft name or cut:<model>:<L>")
    if mode:
        p.add_argument("--mode", default="s2d",
                       help="s2d (adaptive exits) | ar (target only) | lookup (prompt lookup alone) | exit:<layer>")
    p.add_argument("--policy", choices=["heuristic", "fixed", "auto"], default=None,
                   help="draft length policy: auto = cost-based and load-aware (default: the profile's)")
    p.add_argument("--k", type=int, default=None,
                   help="fixed k, or the heuristic's starting k; a tree's spine depth (default: the profile's, else 5)")
    p.add_argument("--width", type=int, default=None, help="token tree: draft candidates per depth (1 = chain)")
    p.add_argument("--frontier", type=int, default=None,
                   help="token tree: nodes the draft expands per depth (EAGLE-2 frontier; 1 = the top-1 spine)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="add prompt-lookup candidates to the tree (default: the profile's)")
    p.add_argument("--lookup-candidates", type=int, default=None,
                   help="distinct prompt-lookup continuations per round, as tree branches (default: the profile's, "
                   "else 1)")
    p.add_argument("--max-nodes", type=int, default=None, help="most tree nodes verified per sequence and round")
    p.add_argument("--exits", type=INTS, default=None, help="override the draft's exits, e.g. 2,4,6")
    p.add_argument("--thresholds", type=FLOATS, default=None, help="override thresholds, e.g. 0.5,0.5,0")
    p.add_argument("--stop-confidence", type=float, default=0.0,
                   help="stop drafting when the draft's probability of its token falls below this")
    p.add_argument("--calibration", default="auto",
                   help="per-target profile from `s2d calibrate`; auto: the draft's committed one; off: none")
    p.add_argument("--dtype", default="auto", choices=get_args(DType),
                   help="weights dtype; auto (default): bfloat16 where it is the fast path (CPU with AVX512-BF16 or "
                   "AMX), float32 elsewhere; the calibration profile is the one for the dtype used")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--wide-threads", type=int, default=None,
                   help="torch threads for passes of >= 16 positions (prompts, trees, big batches); default: --threads")


def engine_config(args: argparse.Namespace, target: str | None = None, mode: str | None = None) -> EngineConfig:
    """The EngineConfig the flags describe (for `target` and `mode` when given: bench runs several)."""
    return EngineConfig(
        target=TargetConfig(name=target or args.target, dtype=resolve_dtype(args.dtype), calibration=args.calibration),
        draft=DraftConfig(source=args.draft, exit_layers=args.exits, thresholds=args.thresholds,
                          stop_confidence=args.stop_confidence),
        spec=spec_config(args, mode or args.mode),
        num_threads=args.threads, wide_threads=args.wide_threads,
    )


SPEC_FLAGS = ("policy", "k", "width", "lookup", "max_nodes", "frontier", "lookup_candidates")


def spec_config(args: argparse.Namespace, mode: str) -> SpecConfig:
    """Only what the user gave is set, so a calibration profile can fill in the rest (policy, k, tree shape)."""
    given = {f: getattr(args, f, None) for f in SPEC_FLAGS}
    return SpecConfig(mode=mode, **{f: v for f, v in given.items() if v is not None})
