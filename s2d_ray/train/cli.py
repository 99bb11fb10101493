"""`s2d train-draft`, `s2d self-distill` and `s2d calibrate`: thin shells over s2d_ray.train."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from ..build import set_threads
from ..commands.engine_args import FLOATS, INTS
from ..config import DEFAULT_TARGET, GSM8K_TEST, TRAIN_DATA, data_file
from ..errors import ConfigError
from .data import check_token_rows

logger = logging.getLogger(__name__)
DATA_HELP = "(default $S2D_DATA_DIR/train/instructions.jsonl)"


def register(sub) -> None:
    _register_train(sub)
    _register_selfdistill(sub)
    _register_lora(sub)
    from .calibrate_cli import register_calibrate

    register_calibrate(sub)


def _register_train(sub) -> None:
    p = sub.add_parser("train-draft", help="train a sorted draft with SoFT (CE at every exit, optional KD)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="the model whose first layers the draft copies")
    p.add_argument("--out", required=True, help="run directory (checkpoints, metrics.jsonl)")
    p.add_argument("--save", default=None, help="write the trained draft directory here at the end")
    p.add_argument("--data", nargs="+", default=None,
                   help=f"JSONL instruction rows / ShareGPT / self-distilled {DATA_HELP}")
    p.add_argument("--sources", nargs="+", default=None, help="only rows whose `source` starts with one of these")
    p.add_argument("--layers", type=int, default=6, help="number of draft layers L")
    p.add_argument("--exits", type=INTS, default=None, help="exit layers, e.g. 2,4,6 (default: thirds of L)")
    p.add_argument("--exit-weights", type=FLOATS, default=None, help="loss weight per exit (default: equal)")
    p.add_argument("--kd-target", nargs="*", default=[], help="targets whose logits the draft also distils")
    p.add_argument("--kd-weight", type=float, default=0.0, help="weight of the KD term (0..1)")
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--exit-distill", type=float, default=0.0,
                   help="weight of distilling the deepest exit into every shallower one (the deepest detached)")
    p.add_argument("--kd-cache", default=None,
                   help="directory for the KD targets' top-k logits over the packed data: computed once (resumable), "
                        "then KD reads them instead of running the targets every step")
    p.add_argument("--kd-topk", type=int, default=32, help="logits kept per position in --kd-cache")
    p.add_argument("--kd-cache-dtype", default=None, choices=["float32", "bfloat16", "auto"],
                   help="run the targets in this dtype to build --kd-cache (bfloat16: faster on CPUs with "
                        "AVX512-BF16, much slower without; auto: bfloat16 where it is the fast path, as --dtype auto; "
                        "default: the training dtype)")
    p.add_argument("--train-norm-head", action="store_true", help="also train an own copy of norm and LM head")
    p.add_argument("--vocab-size", type=int, default=0, help="reduced draft vocabulary (0 = full)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--val-examples", type=int, default=48)
    p.add_argument("--onpath-data", nargs="+", default=None,
                   help="self-distilled held-out rows for on-path agreement, one file per target (the first is the "
                        "curve's; all are reported)")
    p.add_argument("--limit-examples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stop-at", type=int, default=None, help="stop (checkpointed) at this step; schedule of --steps")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop (checkpointed) after the step that ends S seconds after this command started (loading "
                        "and the KD cache build count); --save still writes the draft of that step")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the draft, targets, batches and validation run (auto: cuda when torch sees a GPU); "
                        "checkpoints hold CPU tensors, so a run may resume on another device")
    p.add_argument("--autocast", default=None, choices=["bfloat16", "auto"],
                   help="the draft's forward and backward under bf16 autocast, weights and losses in float32 (auto: "
                        "where bf16 is the fast path: AVX512-BF16/AMX CPUs, CUDA); a faster step on such a CPU")
    p.add_argument("--init", default=None, help="start from this draft directory (e.g. a shorter run's draft; it may have "
                   "fewer layers than --layers: a deeper draft grows from it, the target's next layers after)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--resume-draft", default=None, metavar="DIR",
                   help="with --resume, where --out holds no checkpoint (another machine): continue from this draft "
                        "the run exported (--save / --export-only; bf16 weights, the optimiser restarts with a warmup)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--export-only", action="store_true", help="write --save from the checkpoint in --out; no training")
    p.add_argument("--num-workers", type=int, default=1,
                   help="data-parallel workers on Ray Train (1: this process, without Ray); each takes an equal slice "
                        "of every --batch-size batch, so the run is the one-process run (docs/TRAINING.md)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="with --num-workers > 1: 0 = DDP, 1/2 = DeepSpeed ZeRO stage (optimiser state / and "
                        "gradients sharded); 3 is refused (the draft's weights must stay whole)")
    _add_ray_args(p)
    p.add_argument("--max-failures", type=int, default=2,
                   help="restarts of the worker group from its last checkpoint after a worker dies")
    p.set_defaults(func=run_train)


def _add_ray_args(p) -> None:
    """Where --num-workers > 1 runs, and what each worker reserves there."""
    p.add_argument("--address", default=None,
                   help="Ray cluster for --num-workers > 1: auto (the running one), ray://host:10001, or none for a "
                        "local one")
    p.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="logical CPUs each worker reserves (and its threads unless --threads)")


def _one_or_list(values: list[str] | None) -> str | list[str] | None:
    """One file stays a string, as configs (and checkpoints) from before several files were allowed store it."""
    return values[0] if values and len(values) == 1 else values


def run_train(args: argparse.Namespace) -> int:
    import time

    from .soft import Run, SoftConfig, export_checkpoint

    started = time.monotonic()
    set_threads(args.threads)
    if args.export_only:
        if not args.save:
            raise ValueError("--export-only needs --save")
        manifest = export_checkpoint(Path(args.out), Path(args.save), "s2d " + shlex.join(sys.argv[1:]))
        print(json.dumps({k: manifest[k] for k in ("steps", "train_tokens", "wall_s")}))
        return 0
    data = args.data or [str(data_file(TRAIN_DATA, "--data"))]
    cfg = SoftConfig(target=args.target, out=args.out, data=data, sources=args.sources, num_layers=args.layers,
                     exit_layers=args.exits, exit_weights=args.exit_weights, kd_targets=args.kd_target,
                     kd_weight=args.kd_weight, kd_temperature=args.kd_temperature,
                     kd_cache=args.kd_cache, kd_topk=args.kd_topk, exit_distill=args.exit_distill,
                     kd_cache_dtype=args.kd_cache_dtype,
                     train_norm_head=args.train_norm_head, vocab_size=args.vocab_size, seq_len=args.seq_len,
                     batch_size=args.batch_size, steps=args.steps, lr=args.lr, warmup=args.warmup,
                     weight_decay=args.weight_decay, val_every=args.val_every, ckpt_every=args.ckpt_every,
                     val_examples=args.val_examples, onpath_data=_one_or_list(args.onpath_data), seed=args.seed,
                     threads=args.threads, limit_examples=args.limit_examples, init=args.init, device=args.device,
                     autocast=args.autocast)
    if cfg.kd_weight > 0 and not cfg.kd_targets:
        raise ValueError("--kd-weight > 0 needs at least one --kd-target")
    if cfg.kd_topk < 1:
        raise ValueError("--kd-topk must be >= 1")
    if cfg.exit_distill < 0:
        raise ValueError("--exit-distill must be >= 0")
    if cfg.exit_weights and len(cfg.exit_weights) != len(cfg.exits()):
        raise ValueError(f"--exit-weights needs one weight per exit ({len(cfg.exits())})")
    if args.resume_draft and not args.resume:
        raise ValueError("--resume-draft needs --resume")
    check_token_rows([Path(d) for d in cfg.data], load_tokenizer(cfg.target), cfg.target)
    if args.num_workers != 1 or args.address:
        return _train_on_ray(cfg, args)
    if args.zero:
        raise ValueError("--zero shards across workers: it needs --num-workers > 1")
    run = Run(cfg)
    if args.resume and not run.resume():
        if args.resume_draft:
            run.resume_from_draft(Path(args.resume_draft))
        else:
            logger.warning("no checkpoint in %s: starting fresh", args.out)
    elif not args.resume and (Path(args.out) / "checkpoint.pt").exists():
        raise ValueError(f"{args.out} already holds a run; pass --resume to continue it or pick another --out")
    deadline = None if args.time_limit is None else started + args.time_limit
    run.train(progress=not args.no_progress, until=args.stop_at, deadline=deadline)
    final = run.history[-1] if run.history else {}
    if args.save:
        run.save_draft(Path(args.save), "s2d " + shlex.join(sys.argv[1:]))
    print(json.dumps({"steps": run.step, "train_tokens": run.tokens, "wall_s": round(run.wall, 1), **final}))
    return 0


def _train_on_ray(cfg, args: argparse.Namespace) -> int:
    """`train-draft --num-workers N`: the same run on Ray Train workers (ray_train.py)."""
    import torch

    from .cluster import WorkerSpec
    from .ray_train import ParallelTraining, train_on_ray
    from .soft import check_same_run

    if args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    if args.resume_draft:
        raise ValueError("--resume-draft runs in one process: resume there, then continue with --num-workers")
    checkpoint = Path(args.out) / "checkpoint.pt"
    if checkpoint.exists() and not args.resume:
        raise ValueError(f"{args.out} already holds a run; pass --resume to continue it or pick another --out")
    if checkpoint.exists():  # a resume with other settings is refused here, before any worker starts
        check_same_run(torch.load(checkpoint, mmap=True, weights_only=False, map_location="cpu")["cfg"], cfg,
                       checkpoint)
    workers = WorkerSpec(num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker, address=args.address)
    plan = ParallelTraining(workers=workers, zero=args.zero, max_failures=args.max_failures, resume=args.resume,
                            stop_at=args.stop_at, time_limit=args.time_limit, save=args.save,
                            command="s2d " + shlex.join(sys.argv[1:]), progress=not args.no_progress)
    print(json.dumps(train_on_ray(cfg, plan)))
    return 0


def load_tokenizer(source: str):
    """A model source's tokenizer alone (what data checks need before any weights load)."""
    from transformers import AutoTokenizer

    from ..models.sources import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(source, progress=False))


def _register_selfdistill(sub) -> None:
    p = sub.add_parser("self-distill", help="generate the targets' own greedy responses to training instructions")
    p.add_argument("--target", nargs="+", default=[DEFAULT_TARGET],
                   help="one or more targets; several need a directory --out (chunks go round-robin over them)")
    p.add_argument("--data", default=None, help=f"instruction rows {DATA_HELP}")
    p.add_argument("--out", required=True,
                   help="a .jsonl file to append to (one target), or a directory of gzip chunks; both resumable")
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--num", type=int, default=None, help="number of instructions (default: all of the split)")
    p.add_argument("--gsm8k-fraction", type=float, default=0.25, help="share of gsm8k_train rows")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="rows per engine batch (= per chunk file)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="bfloat16 decodes a batch faster on CPUs with AVX512-BF16/AMX (and on GPUs)")
    p.add_argument("--stop-after", type=int, default=None, help="directory mode: stop after N more chunks")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="directory mode: only chunks whose index %% N == I (N processes share one --out)")
    p.add_argument("--num-workers", type=int, default=1,
                   help="directory mode: generate the chunks on N Ray actors, each with its own engine (1: this "
                        "process); a chunk's bytes do not depend on N (with the same --threads)")
    _add_ray_args(p)
    p.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each actor reserves")
    p.set_defaults(func=run_selfdistill)


def run_selfdistill(args: argparse.Namespace) -> int:
    from .data import data_hash
    from .selfdistill import generate_chunks, generate_responses, pick_rows

    if (args.num is not None and args.num < 1) or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--num, --batch-size and --max-new-tokens must be >= 1")
    out = Path(args.out)
    single = out.suffix == ".jsonl"
    if single and len(args.target) > 1:
        raise ValueError("several --target need a directory --out (not a .jsonl file)")
    if args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    if single and (args.num_workers > 1 or args.address):
        raise ValueError("--num-workers and --address need a directory --out (chunks), not a .jsonl file")
    if args.gpus_per_worker and args.num_workers == 1 and not args.address:
        raise ValueError("--gpus-per-worker is for Ray actors: it needs --num-workers > 1 or --address")
    set_threads(args.threads)
    fraction = {"gsm8k_train": args.gsm8k_fraction} if args.gsm8k_fraction > 0 else None
    data = Path(args.data) if args.data else data_file(TRAIN_DATA, "--data")
    rows = pick_rows(data, args.num, args.seed, args.split, fraction)
    if single:
        made = generate_responses(args.target[0], rows, out, args.max_new_tokens, args.batch_size,
                                  threads=args.threads, dtype=args.dtype)
        print(json.dumps({"rows": len(rows), "generated_tokens": made, "out": args.out}))
        return 0
    picked = {"data": data.name, "data_sha256_16": data_hash([data]), "split": args.split,
              "num": args.num, "gsm8k_fraction": args.gsm8k_fraction, "seed": args.seed}
    pool = None
    if args.num_workers > 1 or args.address:
        from .cluster import WorkerSpec
        from .pool import ChunkPool

        spec = WorkerSpec(num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
                          gpus_per_worker=args.gpus_per_worker, address=args.address)
        pool = ChunkPool(spec, args.threads, args.dtype, args.max_new_tokens)
    try:
        info = generate_chunks(args.target, rows, out, picked, args.max_new_tokens, args.batch_size,
                               threads=args.threads, dtype=args.dtype, stop_after=args.stop_after,
                               shard=parse_shard(args.shard), pool=pool)
    finally:
        if pool is not None:
            pool.close()
    print(json.dumps({"rows": len(rows), **info, "out": args.out}))
    return 0


def _register_lora(sub) -> None:
    p = sub.add_parser("train-lora", help="fit a LoRA adapter on instruction rows of some sources (gsm8k_train by "
                                          "default: the second target)")
    p.add_argument("--base", default=DEFAULT_TARGET)
    p.add_argument("--data", default=None, help=f"instruction rows {DATA_HELP}")
    p.add_argument("--sources", nargs="+", default=["gsm8k_train"],
                   help="train on rows whose source starts with one of these")
    p.add_argument("--max-len", type=int, default=320, help="skip rows longer than this many tokens")
    p.add_argument("--out", required=True, help="adapter directory (what PeftModel.save_pretrained writes)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run_lora)
    e = sub.add_parser("eval-gsm8k", help="greedy GSM8K accuracy of a target (decoded by the engine, ar mode)")
    e.add_argument("--target", default=DEFAULT_TARGET)
    e.add_argument("--test", default=None, help="GSM8K problems (default $S2D_DATA_DIR/gsm8k_test_dev/test_dev.jsonl)")
    e.add_argument("--num", type=int, default=50, help="first N problems")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--out", default=None, help="write per-problem predictions here (JSON)")
    e.set_defaults(func=run_eval_gsm8k)


def run_lora(args: argparse.Namespace) -> int:
    from .lora import train_lora

    if args.steps < 1 or args.batch_size < 1 or args.max_len < 2:
        raise ValueError("--steps and --batch-size must be >= 1, --max-len >= 2")
    set_threads(args.threads)
    data = Path(args.data) if args.data else data_file(TRAIN_DATA, "--data")
    info = train_lora(args.base, data, Path(args.out), args.steps, args.batch_size, args.lr, args.rank,
                      max_len=args.max_len, seed=args.seed, sources=tuple(args.sources))
    print(json.dumps(info))
    return 0


def run_eval_gsm8k(args: argparse.Namespace) -> int:
    from .lora import gsm8k_accuracy

    if args.num < 1:
        raise ValueError("--num must be >= 1")
    set_threads(args.threads)
    test = Path(args.test) if args.test else data_file(GSM8K_TEST, "--test")
    res = gsm8k_accuracy(args.target, test, args.num, args.max_new_tokens, args.batch_size, args.threads,
                         args.dtype)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "outputs"}))
    return 0


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """`I/N` -> (I, N) with 0 <= I < N."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"--shard {text}: need 0 <= I < N")
    return i, n
