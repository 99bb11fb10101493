"""The engine flags every engine-building command shares (generate, bench spec/steps, calibrate), defined once, the
per-request logits flags (penalties, biases, stop ids, a grammar) and the one comma-list argument type."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, TypeVar, get_args

from ..config import (
    DEFAULT_DRAFT, DEFAULT_TARGET, DType, DraftConfig, EngineConfig, SpecConfig, SuffixConfig, TargetConfig,
)
from ..errors import RequestError
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
    p.add_argument("--suffix-tokens", type=int, default=None, metavar="N",
                   help="draft from earlier outputs too: keep up to N tokens of finished outputs and propose what "
                   "followed the longest match (docs/CACHING.md); default: off")
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
    p.add_argument("--fixed-threads", action="store_true",
                   help="always --threads / --wide-threads (default: each pass on the count measured fastest for it, "
                   "which keeps decoding going beside a CPU-bound neighbour)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: greedy output equals plain greedy decoding bit for bit and repeats "
                   "run to run, in bf16 too (slower)")


def engine_config(args: argparse.Namespace, target: str | None = None, mode: str | None = None) -> EngineConfig:
    """The EngineConfig the flags describe (for `target` and `mode` when given: bench runs several)."""
    return EngineConfig(
        target=TargetConfig(name=target or args.target, dtype=resolve_dtype(args.dtype), calibration=args.calibration),
        draft=DraftConfig(source=args.draft, exit_layers=args.exits, thresholds=args.thresholds,
                          stop_confidence=args.stop_confidence),
        spec=spec_config(args, mode or args.mode),
        num_threads=args.threads, wide_threads=args.wide_threads, adaptive_threads=not getattr(args, "fixed_threads", False),
        suffix=suffix_config(getattr(args, "suffix_tokens", None)),
        deterministic=getattr(args, "deterministic", False),
    )


def suffix_config(max_tokens: int | None) -> SuffixConfig:
    """--suffix-tokens N: the store of earlier outputs, N tokens (absent: off)."""
    if max_tokens is None:
        return SuffixConfig()
    if max_tokens < 1:
        raise RequestError(f"--suffix-tokens is {max_tokens}; it must be >= 1 (leave it out for no store)")
    return SuffixConfig(enabled=True, max_tokens=max_tokens)


SPEC_FLAGS = ("policy", "k", "width", "lookup", "max_nodes", "frontier", "lookup_candidates")


def spec_config(args: argparse.Namespace, mode: str) -> SpecConfig:
    """Only what the user gave is set, so a calibration profile can fill in the rest (policy, k, tree shape)."""
    given = {f: getattr(args, f, None) for f in SPEC_FLAGS}
    return SpecConfig(mode=mode, **{f: v for f, v in given.items() if v is not None})


def bias_item(text: str) -> tuple[int, float]:
    """`ID=BIAS` for --logit-bias."""
    key, sep, value = text.partition("=")
    try:
        if sep:
            return int(key), float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}")


def add_logits_args(p: argparse.ArgumentParser) -> None:
    """The per-request logits flags: penalties, biases, stop ids and a grammar (the HTTP API's fields)."""
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, > 0 (1: off)")
    p.add_argument("--logit-bias", type=bias_item, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop token before this many tokens")
    p.add_argument("--stop-token-ids", type=INTS, default=None, help="more token ids that end a completion")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--bad-words", type=comma_list(str, "words"), default=None, help="words never generated")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                         help="the output is JSON valid against this schema file")
    grammar.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    grammar.add_argument("--regex", default=None, help="the output matches this regular expression")
    grammar.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                         help="the output follows this grammar (llguidance's Lark syntax)")


def check_logits_args(args: argparse.Namespace):
    """The flags' ranges and the grammar (its GrammarSpec, or None), checked before any model loads."""
    check_range("--frequency-penalty", args.frequency_penalty, -2.0, 2.0)
    check_range("--presence-penalty", args.presence_penalty, -2.0, 2.0)
    if not 0.0 < args.repetition_penalty <= 10.0:
        raise RequestError(f"--repetition-penalty is {args.repetition_penalty}; it must be in (0, 10]")
    check_range("--min-tokens", args.min_tokens, 0, None)
    for token, bias in args.logit_bias:
        check_range(f"--logit-bias {token}", bias, -100.0, 100.0)
    return grammar_flag(args)


def logits_processors(args: argparse.Namespace, tokenizer, prompt_len: int, eos: tuple[int, ...], grammar):
    """(stop ids, processors) of one sequence from the (checked) flags; token ids are checked here."""
    from ..structured.requests import PenaltySpec, bad_word_ids, bias_pairs, request_processors, stop_ids

    vocab = len(tokenizer)
    stops = stop_ids(eos, args.stop_token_ids, args.ignore_eos, vocab)
    spec = PenaltySpec(frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                       repetition_penalty=args.repetition_penalty,
                       logit_bias=bias_pairs({str(i): b for i, b in args.logit_bias}, vocab),
                       min_tokens=args.min_tokens, bad_words=bad_word_ids(tokenizer, args.bad_words))
    return stops, request_processors(tokenizer, prompt_len, stops, spec, grammar)


def grammar_flag(args: argparse.Namespace):
    from ..structured import GrammarSpec

    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except ValueError as exc:
            raise RequestError(f"--json-schema {args.json_schema}: not JSON ({exc})") from None
        return GrammarSpec.json_schema(schema, "--json-schema")
    if args.json_object:
        return GrammarSpec("json_object", "", "--json-object")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex, "--regex")
    if args.grammar is not None:
        return GrammarSpec("grammar", args.grammar.read_text(), "--grammar")
    return None


def check_range(flag: str, value: float, low: float, high: float | None) -> None:
    if value < low or (high is not None and value > high):
        raise RequestError(f"{flag} is {value}; it must be in [{low}, {'inf' if high is None else high}]")
