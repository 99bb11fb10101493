"""`s2d bench lora`: N LoRA adapters over one base against the same adapters merged into N targets.

Memory: the base's weights once plus each adapter's low-rank factors (and the resident slots a verifier stacks),
against N full copies. Throughput: the same requests spread over 1, 2, 4, 8 adapters, decoded (a) by ONE engine over
the base, every adapter's rows in the same verification forwards, and (b) by one engine per merged target, each
decoding its own requests (what N separate targets do on one machine); S2D with the one sorted draft and plain
decoding, greedy. Outputs of (a) and (b) are compared token for token.

The adapters are random peft LoRAs of the base (seeded, small so the fine-tunes stay close to the base as real
ones do; acceptance depends on that), or the real adapters given with `--adapter` (paths, or committed adapters'
names), and beyond as many as were given, copies of them with seeded noise.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

ADAPTER_COUNTS = (1, 2, 4, 8)
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Write a short poem about the sea and the sky.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what speculative decoding does, briefly.",
    "def fibonacci(n):",
    "Translate to German: good morning, how are you today?",
    "List three uses of a paperclip.",
    "Summarize: the quick brown fox jumps over the lazy dog.",
]


def register(bench) -> None:
    from ..commands.engine_args import add_engine_args

    p = bench.add_parser("lora", help="N LoRA adapters on one base vs N merged targets: memory, and throughput with "
                         "requests spread over 1, 2, 4, 8 adapters (S2D and plain)")
    add_engine_args(p, mode=False)
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")], default=list(ADAPTER_COUNTS),
                   help="adapter counts to measure (comma list; default 1,2,4,8)")
    p.add_argument("--adapter", action="append", default=[], metavar="PATH_OR_NAME",
                   help="a real peft adapter of the target (repeatable; a path or a committed adapter's name such as "
                   "smollm2-135m-gsm8k); counts above those given use noisy copies of them")
    p.add_argument("--rank", type=int, default=8, help="rank of the random adapters")
    p.add_argument("--scale", type=float, default=0.002, help="std of the random adapters' factors")
    p.add_argument("--requests", type=int, default=8, help="requests per measurement, spread over the adapters")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="s2d,ar", help="comma list of s2d and ar")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..build import build_engine, set_threads
    from ..commands.engine_args import engine_config
    from ..prompts import encode_prompt

    if min(args.adapters) < 1 or args.requests < 1 or args.max_new_tokens < 1:
        raise ValueError("--adapters, --requests and --max-new-tokens must be >= 1")
    methods = [m for m in args.methods.split(",") if m]
    if not set(methods) <= {"s2d", "ar"}:
        raise ValueError(f"--methods: s2d and/or ar, got {args.methods}")
    base = build_engine(engine_config(args, mode="ar"))
    set_threads(base.cfg.num_threads)
    model, tok = base.target.model, base.target.tokenizer
    prompts = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)], chat=True) for i in range(args.requests)]
    most = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        paths = adapters(model, Path(tmp), most, args)
        report = {"target": args.target, "draft": args.draft, "rank": args.rank, "requests": args.requests,
                  "adapters": args.adapter or "random",
                  "max_new_tokens": args.max_new_tokens, "memory": memory(model, paths, args.adapters),
                  "throughput": []}
        for method in methods:
            for n in args.adapters:
                row = throughput(args, method, base.target, paths[:n], prompts)
                report["throughput"].append(row)
                print(f"{method} adapters={n}: one base {row['lora_tok_s']:.1f} tok/s, {n} merged targets "
                      f"{row['merged_tok_s']:.1f} tok/s, outputs equal {row['equal']}/{len(prompts)}", flush=True)
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def adapters(model, tmp: Path, most: int, args: argparse.Namespace) -> list[Path]:
    """`most` adapter directories: the real ones given (then noisy copies of them), else random ones."""
    from ..serve.lora_config import adapter_path

    if not args.adapter:
        return [random_adapter(model, tmp / f"a{i}", i, args.rank, args.scale) for i in range(most)]
    real = [adapter_path(a) for a in args.adapter]
    missing = [a for a, p in zip(args.adapter, real) if not (p / "adapter_config.json").is_file()]
    if missing:
        raise ValueError(f"--adapter {missing[0]}: not a peft adapter directory (no adapter_config.json)")
    return [real[i] if i < len(real) else noisy_copy(real[i % len(real)], tmp / f"a{i}", i) for i in range(most)]


def noisy_copy(src: Path, path: Path, seed: int, relative: float = 0.1) -> Path:
    """A copy of the adapter at `src` with seeded noise of `relative` times each factor's std added: another
    adapter of the same shapes and about the same closeness to the base."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True)
    shutil.copy(src / "adapter_config.json", path / "adapter_config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: t + torch.randn(t.shape, generator=gen, dtype=t.dtype) * t.std() * relative
               for k, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model, path: Path, seed: int, rank: int, scale: float, modules=LLAMA_PROJECTIONS,
                   rslora: bool = False) -> Path:
    """A seeded random peft LoRA of `model` saved at `path` (both factors random, so it changes the output); `model`
    is left as it was."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, lora_dropout=0.0,
                     target_modules=list(modules), use_rslora=rslora)
    peft = get_peft_model(copy.deepcopy(model), cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    peft.save_pretrained(str(path))
    return path


def merged_model(model, path: Path):
    """`model` with the adapter at `path` merged into its weights (peft merge_and_unload), on a copy."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(path)).merge_and_unload().eval()


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def memory(model, paths: list[Path], counts: list[int]) -> list[dict]:
    """Weight bytes of N adapters over one base (base + factors + the verifier's stacked slots) and of N merged
    copies, from the tensors themselves."""
    from ..core.lora import LoraBank
    from ..models.adapters import read_peft_adapter

    base = _bytes(model)
    rows = []
    for n in counts:
        bank = LoraBank(max_loaded=n, max_rank=max(read_peft_adapter(p).rank for p in paths[:n]))
        bank.wrap(model.model.layers)
        factors = 0
        for i, p in enumerate(paths[:n]):
            weights = read_peft_adapter(p, f"a{i}")
            bank.register(weights)
            factors += sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                           for a, b in bank.registered[f"a{i}"].factors.values())
        lora = base + factors + bank.resident_bytes()
        rows.append({"adapters": n, "lora_bytes": lora, "merged_bytes": n * base,
                     "per_adapter_bytes": (lora - base) / n, "saved_fraction": 1 - lora / (n * base)})
    return rows


def throughput(args, method: str, loaded, paths: list[Path], prompts: list[list[int]]) -> dict:
    """The requests round-robin over the adapters: one engine over the base vs one engine per merged target."""
    from ..build import assemble_engine, build_draft, build_drafter, build_verifier, load_profile
    from ..commands.engine_args import engine_config
    from ..core.engine import GenerationRequest
    from ..core.lora import LoraBank
    from ..models.adapters import read_peft_adapter

    cfg, model = engine_config(args, mode=method), loaded.model
    profile = load_profile(cfg)
    draft = build_draft(cfg, loaded, profile) if method == "s2d" else None  # the base's: one draft for all
    names = [f"a{i}" for i in range(len(paths))]
    reqs = [GenerationRequest(f"r{i}", p, args.max_new_tokens, adapter=names[i % len(names)])
            for i, p in enumerate(prompts)]

    def engine(verifier):
        return assemble_engine(cfg, verifier, build_drafter(draft, cfg) if draft is not None else None, profile,
                               max_context=None, detokenize=None)

    bank = LoraBank(max_loaded=len(paths), max_rank=max(read_peft_adapter(p).rank for p in paths))
    one = engine(build_verifier(model, cfg, lora=bank))
    for name, path in zip(names, paths):
        bank.register(read_peft_adapter(path, name))
    one.generate([GenerationRequest("warm", prompts[0], 8, adapter=names[0])])
    start = time.perf_counter()
    lora_out = {r.seq_id: r.token_ids for r in one.generate(reqs)}
    lora_s = time.perf_counter() - start

    merged = {name: engine(build_verifier(merged_model(model, path), cfg)) for name, path in zip(names, paths)}
    for e in merged.values():
        e.generate([GenerationRequest("warm", prompts[0], 8)])
    start = time.perf_counter()
    merged_out = {}
    for name, e in merged.items():  # each target decodes its own requests
        mine = [GenerationRequest(r.seq_id, r.prompt_ids, r.max_new_tokens) for r in reqs if r.adapter == name]
        merged_out.update({r.seq_id: r.token_ids for r in e.generate(mine)})
    merged_s = time.perf_counter() - start
    tokens = sum(len(t) for t in lora_out.values())
    return {"method": method, "adapters": len(paths), "lora_tok_s": tokens / lora_s,
            "merged_tok_s": sum(len(t) for t in merged_out.values()) / merged_s,
            "equal": sum(lora_out[k] == merged_out[k] for k in lora_out)}


def table(report: dict) -> str:
    lines = ["| adapters | one base + adapters (MiB) | merged targets (MiB) | per adapter (MiB) |", "|---|---|---|---|"]
    for m in report["memory"]:
        lines.append(f"| {m['adapters']} | {m['lora_bytes'] / 2**20:.1f} | {m['merged_bytes'] / 2**20:.1f} | "
                     f"{m['per_adapter_bytes'] / 2**20:.2f} |")
    lines += ["", "| method | adapters | one base (tok/s) | merged targets (tok/s) | equal outputs |",
              "|---|---|---|---|---|"]
    for t in report["throughput"]:
        lines.append(f"| {t['method']} | {t['adapters']} | {t['lora_tok_s']:.1f} | {t['merged_tok_s']:.1f} | "
                     f"{t['equal']}/{report['requests']} |")
    return "\n".join(lines)
