"""SoFT (sorted fine-tuning): one forward through the draft's L layers, CE at every exit, averaged.

Options beyond the paper: per-exit weights; a KD term from one or several targets' logits (temperature, weight);
training the norm and head too; a reduced-vocabulary head. Validation reports each exit's top-1 agreement with the
target's greedy next token on held-out text AND along the target's own greedy continuations (on-path), which is what
speculation sees. Checkpoints are atomic; `resume` continues the same run (same data order, optimiser, schedule).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..hardware import resolve_dtype
from ..core.draft import SortedDraft, default_exits, paper_thresholds
from ..build import make_kernels
from ..models import load_model
from ..models.drafts import load_draft, save_draft
from .data import Packed, batches, data_hash, load_examples, pack, visit_order
from .forward import SubVocab, exit_logits, soft_loss, target_logits
from .kdcache import TopKCache, target_cache_dir
from .validate import Validator

logger = logging.getLogger(__name__)
CKPT = "checkpoint.pt"
# Settings a resumed run may change: how long it runs, where (a run moves between machines: checkpoints hold CPU
# tensors and load onto any device; its directory, its KD cache's and its thread count are the new machine's) and how
# often it checkpoints. None of them changes what a step computes (the KD cache checks its own rows and settings)
# beyond rounding: the same holds for the precision the new machine computes fast, the targets' dtype while they build
# the KD cache and bf16 autocast of the draft's steps (a CPU without AVX512-BF16 runs bf16 far slower than fp32; a
# cache of another dtype is refused by the cache itself, so one cache never mixes two).
RESUME_MAY_CHANGE = ("steps", "device", "ckpt_every", "out", "kd_cache", "threads", "kd_cache_dtype", "autocast")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class SoftConfig:
    """Everything a run depends on (stored in the checkpoint and the manifest)."""

    target: str = "smollm2-135m-instruct"
    out: str = "runs/draft"
    data: list[str] = field(default_factory=list)  # training files (the CLI defaults to the data directory's)
    sources: list[str] | None = None
    num_layers: int = 6
    exit_layers: list[int] | None = None
    exit_weights: list[float] | None = None
    kd_targets: list[str] = field(default_factory=list)
    kd_weight: float = 0.0
    kd_temperature: float = 1.0
    exit_distill: float = 0.0  # weight of KL(deepest exit || each shallower exit), the deepest exit detached
    kd_cache: str | None = None  # directory of the targets' cached top-k logits (built on first use; kdcache.py)
    kd_topk: int = 32
    kd_cache_dtype: str | None = None  # the targets' dtype while building the cache (None: `dtype`; auto: bf16
    # where it is the fast path here, else float32)
    train_norm_head: bool = False
    vocab_size: int = 0  # 0: full vocabulary; else the most frequent label tokens of the training data
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1000
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    val_every: int = 100
    ckpt_every: int = 50
    val_examples: int = 48
    onpath_data: str | list[str] | None = None  # held-out greedy responses, one file per target (first: the curve)
    seed: int = 0
    threads: int | None = None
    dtype: str = "float32"
    autocast: str | None = None  # bfloat16 | auto: the draft's forward and backward under bf16 autocast (fp32 weights)
    limit_examples: int | None = None
    init: str | None = None  # a draft directory to start from (its layers, and its vocabulary if reduced)
    device: str = "auto"  # auto | cpu | cuda (auto: cuda when available); not part of the run's identity on resume

    def exits(self) -> list[int]:
        return self.exit_layers or default_exits(self.num_layers)


def resolve_autocast(name: str | None, device: torch.device) -> bool:
    """Whether the draft's steps run under bf16 autocast: `bfloat16` yes, `auto` where bf16 is the fast path on the
    device (hardware.resolve_dtype: AVX512-BF16/AMX CPUs, CUDA), None no. Weights, optimiser and losses stay
    float32; the matmuls run in bf16, so a step is faster on an AVX512-BF16 CPU and its losses stay close to fp32's
    (docs/TRAINING.md)."""
    if name is None:
        return False
    if name not in ("bfloat16", "auto"):
        raise ValueError(f"autocast must be bfloat16 or auto, got {name!r}")
    return name == "bfloat16" or resolve_dtype("auto", device.type) == "bfloat16"


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` without a GPU is refused."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but torch sees no GPU; use --device cpu (or auto)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_cpu(state):
    """A (nested) state with every tensor on the CPU, as checkpoints store it (CPU tensors are kept as they are)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


class Run:
    """A SoFT run: models, data, optimiser, state; `train()` runs to cfg.steps, checkpointing on the way."""

    def __init__(self, cfg: SoftConfig) -> None:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        logger.info("training on %s (--device %s)", self.device, cfg.device)
        self.autocast = resolve_autocast(cfg.autocast, self.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        dtype = getattr(torch, cfg.dtype)
        self.target = load_model(cfg.target, dtype=dtype)
        self.kd_models = [self.target.model if s == cfg.target else load_model(s, dtype=dtype).model
                          for s in cfg.kd_targets]
        self.examples = load_examples([Path(p) for p in cfg.data], self.target.tokenizer, "train",
                                      cfg.limit_examples, cfg.sources, seed=cfg.seed)
        if not self.examples:
            raise ValueError(f"no training examples in {cfg.data} (sources={cfg.sources})")
        self.rows = pack(self.examples, cfg.seq_len)
        init = load_draft(Path(cfg.init), self.target.model) if cfg.init else None
        picked = init.vocab_ids if init is not None and init.vocab_ids is not None else self._pick_vocab()
        self.vocab = SubVocab(picked, self.target.model.config.vocab_size)
        self.draft, self.params = self._make_draft()
        if init is not None:
            self._load_init(init, grow=True)
        self._place()
        self.kd_caches = self._kd_caches()
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.rewarm_from: int | None = None  # the step a run resumed from an exported draft (fresh optimiser) at
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.step, self.tokens, self.wall = 0, 0, 0.0
        self.history: list[dict] = []
        self.validator = Validator(self, cfg)

    def _place(self) -> None:
        """Everything a step touches onto the run's device (built on the CPU first, as before): the target (whose
        embedding, rotary and, unless trained, norm and head the draft shares), the KD targets, the draft's layers,
        its own norm/head copies and head rows, and the vocabulary maps. Parameters keep their identity (the
        optimiser is made after)."""
        dev = self.device
        if dev.type == "cpu":
            return
        self.target.model.to(dev)
        for model in self.kd_models:
            model.to(dev)
        self.draft.to(dev)
        # The cut was made on the CPU, where the draft's (copied) layers attend through core/attention.py's grouped
        # matmuls; elsewhere they attend as the target's do (SDPA: the fused kernels, no host syncs per block).
        for layer in self.draft.layers:
            attn_cfg = getattr(getattr(layer, "self_attn", None), "config", None)
            if attn_cfg is not None:
                attn_cfg._attn_implementation = self.target.model.config._attn_implementation
        if self.head_rows is not None:
            self.draft.parts.norm.to(dev)
            self.draft.parts.head.to(dev)
            self.head_rows.data = self.head_rows.data.to(dev)
        self.vocab.to(dev)

    def _kd_caches(self) -> list[TopKCache]:
        """With --kd-cache, each KD target's top-k logits over these rows, chunked in the first epoch's visiting order
        and built lazily as steps reach them (resumable; a resumed run builds only what is still ahead)."""
        cfg = self.cfg
        if not cfg.kd_cache or cfg.kd_weight <= 0:
            return []
        dtype = resolve_dtype(cfg.kd_cache_dtype, self.device.type) if cfg.kd_cache_dtype else cfg.dtype
        order = visit_order(len(self.rows), cfg.seed, 0)
        caches = []
        for name, model in zip(cfg.kd_targets, self.kd_models):
            cache = TopKCache(target_cache_dir(Path(cfg.kd_cache), name), name, self.rows, cfg.kd_topk, dtype,
                              order=order)
            cache.missing()  # refuses another run's cache now, not at the first step
            builder = model if dtype == cfg.dtype else load_model(name, dtype=getattr(torch, dtype)).model
            caches.append(cache.attach(builder.to(self.device)))
        return caches

    def _pick_vocab(self) -> torch.Tensor | None:
        if not self.cfg.vocab_size:
            return None
        counts = Counter(t for r in self.rows for t in r.labels[r.labels != -100].tolist())
        tok = self.target.tokenizer
        keep = {t for t, _ in counts.most_common(self.cfg.vocab_size)}
        keep |= {i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None}
        return torch.tensor(sorted(keep))

    def _make_draft(self) -> tuple[SortedDraft, list[nn.Parameter]]:
        cfg = self.cfg
        exits = cfg.exits()
        draft = SortedDraft.cut(self.target.model, cfg.target, cfg.num_layers, exits, paper_thresholds(len(exits)),
                                copy_layers=True, kernels=make_kernels())
        draft.requires_grad_(False)
        draft.layers.requires_grad_(True)
        params = list(draft.layers.parameters())
        self.head_rows = None
        if cfg.train_norm_head:
            draft.parts = copy.copy(draft.parts)
            draft.parts.norm = copy.deepcopy(draft.parts.norm).requires_grad_(True)
            draft.parts.head = copy.deepcopy(draft.parts.head).requires_grad_(False)
            self.head_rows = nn.Parameter(self.vocab.head_weight(draft.parts.head).detach().clone())
            draft.spec.trained_norm_head = True
            params += list(draft.parts.norm.parameters()) + [self.head_rows]
        return draft, params

    def _load_init(self, init: SortedDraft, grow: bool = False) -> None:
        """Start from a saved draft (e.g. a shorter run's). With `grow`, a shallower draft is the first
        layers of a deeper one (the rest stay copies of the target's next layers, as a fresh run makes them): a
        deeper draft then starts from what the trained one learnt instead of from the target's cut."""
        have, want = init.spec.num_layers, self.cfg.num_layers
        if have != want and not (grow and have < want):
            more = " (it may have fewer)" if grow else ""
            raise ValueError(f"--init draft has {have} layers, this run {want}{more}")
        state = {k: v.float() for k, v in init.layers.state_dict().items()}
        missing, unexpected = self.draft.layers.load_state_dict(state, strict=False)
        if unexpected or any(int(key.split(".", 1)[0]) < have for key in missing):
            raise ValueError(f"--init draft's layers do not fit this run's: unexpected {unexpected[:3]}, "
                             f"missing {missing[:3]}")
        if self.head_rows is not None and init.spec.trained_norm_head:
            self.draft.parts.norm.load_state_dict(init.parts.norm.state_dict())
            self.head_rows.data.copy_(self.vocab.head_weight(init.parts.head).float())

    def _lr_factor(self, step: int) -> float:
        warm = max(1, int(self.cfg.warmup * self.cfg.steps))
        if step < warm:
            return (step + 1) / warm
        frac = min(1.0, (step - warm) / max(1, self.cfg.steps - warm))
        factor = self.cfg.min_lr_ratio + (1 - self.cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        if self.rewarm_from is not None and step >= self.rewarm_from:  # Adam's moments restarted: warm up again
            factor *= min(1.0, (step - self.rewarm_from + 1) / warm)
        return factor

    def batch_at(self, step: int) -> Packed:
        """The batch of a global step: epochs are reshuffled by seed, so a resumed run sees the same order."""
        per_epoch = max(1, len(self.rows) // self.cfg.batch_size)
        epoch, i = divmod(step, per_epoch)
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._batches = epoch, batches(self.rows, self.cfg.batch_size, self.cfg.seed, epoch)
            if not self._batches:  # fewer rows than one batch: use them all
                self._batches = batches(self.rows, len(self.rows), self.cfg.seed, epoch)
        return self._batches[i % len(self._batches)]

    def loss_on(self, batch: Packed, shares: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, list[float]]:
        """The SoFT loss of `batch` and each exit's part (`shares`: a data-parallel rank's, forward.soft_loss)."""
        exits = self.cfg.exits()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = exit_logits(self.draft.parts, self.draft.layers, batch, exits, self.vocab, self.head_rows)
        kd = None
        if self.cfg.kd_weight > 0:
            kd = ([c.lookup(batch, self.vocab, self.device) for c in self.kd_caches] if self.kd_caches
                  else [target_logits(m, batch, self.vocab) for m in self.kd_models])
        weights = self.cfg.exit_weights or [1.0] * len(exits)
        return soft_loss(out, weights, kd, self.cfg.kd_weight, self.cfg.kd_temperature, self.cfg.exit_distill, shares)

    def train(self, progress: bool = True, until: int | None = None, deadline: float | None = None) -> list[dict]:
        """Train to cfg.steps (or stop early at `until`, or after the step that ends past `deadline`, a
        time.monotonic() value; checkpointed either way, as an interruption would be)."""
        cfg = self.cfg
        stop = min(until or cfg.steps, cfg.steps)
        bar = tqdm(total=cfg.steps, initial=self.step, desc="SoFT", disable=not progress, dynamic_ncols=True)
        if self.step == 0 and not self.history:
            self.validate()  # the untrained cut: the curve's first point
        while self.step < stop:
            t0 = time.perf_counter()
            batch = self.batch_at(self.step)
            per_exit = self.train_step(batch)
            self.step += 1
            self.tokens += int((batch.labels != -100).sum())
            dt = time.perf_counter() - t0
            self.wall += dt
            bar.update(1)
            bar.set_postfix_str(" ".join(f"L{e}={v:.2f}" for e, v in zip(cfg.exits(), per_exit))
                                + f" tok/s={batch.ids.numel() / dt:.0f}")
            self.last_losses = per_exit
            if self.step % cfg.val_every == 0 or self.step == cfg.steps:
                self.validate()
            late = self.past(deadline)
            if self.step % cfg.ckpt_every == 0 or self.step in (cfg.steps, stop) or late:
                self.save_checkpoint()
            if late and self.step < stop:
                logger.info("time limit reached: stopped at step %d of %d (checkpointed)", self.step, cfg.steps)
                break
        bar.close()
        return self.history

    def train_step(self, batch: Packed) -> list[float]:
        """One optimiser step on `batch` (loss, backward, clip, AdamW, schedule); returns each exit's loss."""
        loss, per_exit = self.loss_on(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        return per_exit

    def validate(self) -> None:
        """Measure the held-out agreement now and add it to the curve."""
        self.record(self.validator.run())

    def past(self, deadline: float | None) -> bool:
        """Whether the run's time limit (a time.monotonic() value) has passed."""
        return deadline is not None and time.monotonic() >= deadline

    def record(self, metrics: dict) -> None:
        entry = {"step": self.step, "tokens": self.tokens, "wall_s": round(self.wall, 1),
                 "train_loss": getattr(self, "last_losses", None), **metrics}
        self.history.append(entry)
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        logger.info("validation %s", json.dumps(entry))

    def trainable_state(self) -> dict:
        state = {"layers": self.draft.layers.state_dict()}
        if self.head_rows is not None:
            state["norm"] = self.draft.parts.norm.state_dict()
            state["head_rows"] = self.head_rows.detach().clone()
        return state

    def checkpoint_state(self, opt_state: dict | None = None) -> dict:
        """What a checkpoint holds, CPU tensors only (model, optimiser state, vocabulary): it resumes on any device.
        `opt_state`: the optimiser's state in torch AdamW's layout when another optimiser holds it (ZeRO)."""
        return {"cfg": asdict(self.cfg), "step": self.step, "tokens": self.tokens, "wall": self.wall,
                "history": self.history, "model": to_cpu(self.trainable_state()),
                "opt": to_cpu(opt_state or self.opt.state_dict()), "sched": self.sched.state_dict(),
                "vocab_ids": to_cpu(self.vocab.ids), "rng": torch.get_rng_state(), "rewarm_from": self.rewarm_from}

    def save_checkpoint(self) -> None:
        """Atomically (a temporary file renamed)."""
        tmp = self.out / (CKPT + ".tmp")
        torch.save(self.checkpoint_state(), tmp)
        tmp.replace(self.out / CKPT)

    def resume(self, path: Path | None = None) -> bool:
        """Continue from the checkpoint at `path` (default: the one in --out); False when there is none."""
        path = Path(path) if path is not None else self.out / CKPT
        if not path.exists():
            return False
        # Onto the CPU first, whichever device wrote it; load_state_dict then copies each tensor to its parameter's
        # device (the optimiser's state too, as torch's Optimizer.load_state_dict casts it to its parameter).
        ck = torch.load(path, weights_only=False, map_location="cpu")
        check_same_run(ck["cfg"], self.cfg, path)
        self.draft.layers.load_state_dict(ck["model"]["layers"])
        if self.head_rows is not None:
            self.draft.parts.norm.load_state_dict(ck["model"]["norm"])
            self.head_rows.data.copy_(ck["model"]["head_rows"])
        self.opt.load_state_dict(ck["opt"])
        self.sched.load_state_dict(ck["sched"])
        self.step, self.tokens, self.wall, self.history = ck["step"], ck["tokens"], ck["wall"], ck["history"]
        self.rewarm_from = ck.get("rewarm_from")
        torch.set_rng_state(ck["rng"])
        logger.info("resumed %s at step %d", path, self.step)
        return True

    def resume_from_draft(self, directory: Path) -> None:
        """Continue this run from a draft it exported (`--save`, `--export-only`): what carries a run to a machine
        without its checkpoint. The export is ~1/6 of a checkpoint (bf16 weights, no optimiser), so it is what
        travels. Not bit-exact: weights come back rounded to bf16 and Adam's
        moments restart, so the learning rate warms up again (as at the start) from the exported step; data order,
        schedule position and the curve continue."""
        directory = Path(directory)
        manifest = json.loads((directory / "MANIFEST.json").read_text())
        check_same_run(manifest["config"], self.cfg, directory)
        init = load_draft(directory, self.target.model)
        mine = None if self.vocab.ids is None else self.vocab.ids.cpu()
        if (init.vocab_ids is None) != (mine is None) or (mine is not None and not torch.equal(init.vocab_ids, mine)):
            raise ValueError(f"{directory} has another draft vocabulary than this run")
        self._load_init(init)
        self.step, self.tokens, self.wall = manifest["steps"], manifest["train_tokens"], manifest["wall_s"]
        self.history = manifest["curve"]
        self.rewarm_from = self.step
        self.sched.last_epoch = self.step
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * self._lr_factor(self.step)
        logger.info("resumed from the exported draft %s at step %d (optimiser restarted)", directory, self.step)

    def export(self) -> SortedDraft:
        """The trained draft as the engine loads it (reduced vocabulary and own norm/head when trained)."""
        draft = self.draft
        if self.head_rows is not None:
            head = draft.parts.head
            with torch.no_grad():
                if self.vocab.ids is None:
                    head.weight.copy_(self.head_rows)
                else:
                    head.weight[self.vocab.ids] = self.head_rows
        return draft.with_vocab(self.vocab.ids) if self.vocab.ids is not None else draft

    def save_draft(self, directory: Path, command: str, dtype: torch.dtype = torch.bfloat16) -> dict:
        draft = self.export()
        draft.spec.provenance = {"trained_by": "s2d train-draft", "target": self.cfg.target, "steps": self.step}
        save_draft(draft, directory, dtype=dtype)
        manifest = {"command": command, "config": asdict(self.cfg),
                    "data_sha256_16": data_hash([Path(p) for p in self.cfg.data]), "steps": self.step,
                    "train_tokens": self.tokens, "wall_s": round(self.wall, 1),
                    "final_metrics": self.history[-1] if self.history else {},
                    "curve": self.history}
        (directory / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
        return manifest


def check_same_run(saved: dict, cfg: SoftConfig, source: Path) -> None:
    """Refuse to continue `saved` (a checkpoint's or an export's config) with `cfg`, naming every setting that
    differs. Fields added after `saved` was written count as equal when `cfg` leaves them at their default;
    RESUME_MAY_CHANGE may differ, and input paths compare as absolute paths (`_identity`)."""
    defaults = asdict(SoftConfig())
    current = {k: v for k, v in asdict(cfg).items() if k in saved or v != defaults[k]}
    old, new = _identity(saved), _identity(current)
    if old != new:
        differ = ", ".join(f"{k} ({old.get(k)!r} there, {new.get(k)!r} now)"
                           for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
        raise ValueError(f"{source} was written by a different configuration: {differ}; use another --out or the "
                         "same flags")


PATH_FIELDS = ("data", "onpath_data", "init")  # files the run reads: the same file whether named relative or absolute


def _identity(cfg: dict) -> dict:
    """What must match for a checkpoint to resume: the configuration less RESUME_MAY_CHANGE, input paths made
    absolute (from the working directory: the repository root for the scripts)."""
    def absolute(v):
        if isinstance(v, list):
            return [absolute(x) for x in v]
        return os.path.abspath(v) if isinstance(v, str) else v

    return {k: absolute(v) if k in PATH_FIELDS else v for k, v in cfg.items() if k not in RESUME_MAY_CHANGE}


def export_checkpoint(run_dir: Path, save_dir: Path, command: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write the draft directory of a run's latest checkpoint without loading its data (what --save writes), on the
    CPU whichever device wrote the checkpoint."""
    ck = torch.load(Path(run_dir) / CKPT, weights_only=False, map_location="cpu")
    cfg = SoftConfig(**ck["cfg"])
    target = load_model(cfg.target, dtype=getattr(torch, cfg.dtype))
    run = Run.__new__(Run)
    run.cfg, run.step, run.tokens, run.wall, run.history = cfg, ck["step"], ck["tokens"], ck["wall"], ck["history"]
    run.vocab = SubVocab(ck["vocab_ids"], target.model.config.vocab_size)
    run.target = target
    run.draft, run.params = Run._make_draft(run)
    run.draft.layers.load_state_dict(ck["model"]["layers"])
    if run.head_rows is not None:
        run.draft.parts.norm.load_state_dict(ck["model"]["norm"])
        run.head_rows.data.copy_(ck["model"]["head_rows"])
    return run.save_draft(Path(save_dir), command, dtype)
