"""Build the one engine from an EngineConfig: CLI, benchmarks and the Ray deployments all come through here."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .config import EngineConfig, SpecConfig, context_window
from .core.budget import SpeculationBudget, TreeShape
from .core.costs import CostModel
from .core.draft import Drafter, SortedDraft, SortedDrafter, default_exits
from .core.engine import SpecEngine
from .core.kernels import Kernels
from .core.lora import LoraBank
from .core.lookup import PromptLookup, TreeDrafter
from .core.policy import DraftLengthPolicy, FixedK, HeuristicK
from .core.prefix_cache import PrefixCacheSpec
from .core.suffix import SuffixStore
from .core.target import TargetVerifier, Verifier
from .errors import ConfigError, ModelLoadError
from .hardware import IdleCores, for_machine, machine_name, resolve_dtype
from .kernels import CpuKernels, DeterministicKernels
from .models import DRAFT_CONFIG, LoadedModel, check_same_vocabulary, default_cache_dir, load_draft, load_model

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
COMMITTED_DRAFTS = ASSETS / "drafts"
# Speculation settings a calibration profile may set (explicit config wins).
PROFILE_SPEC_FIELDS = ("policy", "k", "width", "lookup", "max_nodes", "frontier", "lookup_candidates")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def set_threads(num_threads: int | None) -> None:
    """torch inside Ray actors defaults to 1 thread; set it explicitly everywhere."""
    torch.set_num_threads(num_threads or os.cpu_count() or 1)


def with_resolved_dtype(cfg: EngineConfig, device: str = "cpu") -> EngineConfig:
    """cfg with `dtype: auto` replaced by what it means on `device` (so logs, profiles and Built.cfg name it)."""
    dtype = resolve_dtype(cfg.target.dtype, device)
    if dtype == cfg.target.dtype:
        return cfg
    return cfg.model_copy(update={"target": cfg.target.model_copy(update={"dtype": dtype})})


def make_kernels(cfg: EngineConfig | None = None) -> Kernels:
    """The kernel backend the config (default: the defaults) asks for (core/kernels.py), injected into the verifier
    and the draft: on the CPU, grouped attention and packed projections where they measured faster here, and each
    pass's thread count (`wide_threads`, `adaptive_threads`); elsewhere torch's own kernels. S2D_LINEAR_KERNEL and
    S2D_KERNEL_TIMES override the config's `linear_kernel` and `kernel_times`. `deterministic`: batch-invariant
    kernels on one fixed thread count instead (kernels/deterministic.py)."""
    cfg = cfg if cfg is not None else EngineConfig()
    if cfg.deterministic:
        return DeterministicKernels()
    return CpuKernels.from_settings(cfg.linear_kernel, cfg.kernel_times, default_cache_dir() / "kernel_times.json",
                                    wide_threads=cfg.wide_threads, adaptive_threads=cfg.adaptive_threads,
                                    idle_cores=IdleCores.here)


def check_deterministic_device(cfg: EngineConfig, device: torch.device | str) -> None:
    """`deterministic` only where its guarantee holds: the CPU. On CUDA, RMSNorm's and other reductions' order
    follows the row count, so a verified position would not equal a decode step bit for bit there."""
    if cfg.deterministic and torch.device(device).type != "cpu":
        raise ConfigError(f"deterministic: true runs on the CPU only; on {torch.device(device).type} norms and "
                          "reductions are not batch-invariant yet, so its guarantee would not hold (set "
                          "deterministic: false, or run on the CPU)")


def make_draft_kernels(cfg: EngineConfig | None = None) -> Kernels:
    """The draft's backend: the config's, but never the deterministic one (the target decides every token, so the
    draft needs no determinism and keeps the fast kernels)."""
    cfg = cfg if cfg is not None else EngineConfig()
    return make_kernels(cfg.model_copy(update={"deterministic": False}) if cfg.deterministic else cfg)


def default_device() -> torch.device:
    """The GPU when torch sees one (Ray hides GPUs from actors with num_gpus=0), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_target(cfg: EngineConfig, device: torch.device | str | None = None) -> LoadedModel:
    """The target on `device` (default: `default_device()`); TP ranks pass "cpu" and let DeepSpeed place shards."""
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(cfg.target.dtype, device.type)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    loaded = load_model(cfg.target.resolved_source, dtype=DTYPES[dtype], cache_dir=cache,
                        trust_remote_code=cfg.trust_remote_code, device=device)
    if device.type != "cpu":
        loaded.model.to(device)
    logger.info("model %s on %s in %s", cfg.target.resolved_source, device, dtype)
    return loaded


def draft_dir(source: str) -> Path | None:
    """A committed draft name or a directory; None for `cut:` sources."""
    if source.startswith("cut:"):
        return None
    if (COMMITTED_DRAFTS / source).is_dir():
        return COMMITTED_DRAFTS / source
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    known = sorted(p.name for p in COMMITTED_DRAFTS.glob("*") if p.is_dir())
    raise ModelLoadError(f"draft {source!r} is neither a directory nor a committed draft {known} nor cut:<model>:<L>")


def parse_cut(source: str) -> tuple[str, int, list[int] | None]:
    """`cut:<model>:<layers>[:<e1>,<e2>,...]` -> (model, layers, exits)."""
    parts = source.split(":")
    if len(parts) not in (3, 4) or not parts[2].isdigit():
        raise ConfigError(f"cut draft must look like cut:<model>:<layers>[:<e1>,<e2>,...], got {source!r}")
    exits = [int(e) for e in parts[3].split(",")] if len(parts) == 4 else None
    return parts[1], int(parts[2]), exits


def draft_base_source(source: str, base_model: str | None = None) -> str:
    """The model whose embedding/norm/head (and tokenizer) a draft shares: `base_model` when the configuration gives
    one, else from `cut:<model>:L` or the draft's config file."""
    if base_model:
        return base_model
    directory = draft_dir(source)
    if directory is None:
        return parse_cut(source)[0]
    path = directory / DRAFT_CONFIG
    if not path.is_file():
        raise ModelLoadError(f"{directory} is not a draft directory: it has no {DRAFT_CONFIG}")
    return json.loads(path.read_text())["base_model"]


def build_draft(cfg: EngineConfig, target: LoadedModel, profile: dict | None,
                base: LoadedModel | None = None, kernels: Kernels | None = None,
                base_model: str | None = None) -> SortedDraft:
    """The sorted draft named by cfg.draft (exits from `profile`, see apply_exits), sharing the target's
    embedding/head when its base is the target; its kernels `kernels` (default: make_draft_kernels(cfg));
    `base_model` overrides the base its config records."""
    src = cfg.draft.source
    base_source = draft_base_source(src, base_model)
    base = base or _base_for(base_source, cfg, target)
    kernels = kernels if kernels is not None else make_draft_kernels(cfg)
    directory = draft_dir(src)
    if directory is None:
        _, layers, exits = parse_cut(src)
        draft = SortedDraft.cut(base.model, base_source, layers, exits or default_exits(layers), kernels=kernels)
    else:
        draft = load_draft(directory, base.model, kernels)
    check_same_vocabulary(base.tokenizer, target.tokenizer, f"draft {src}", f"target {cfg.target.name}")
    return apply_exits(draft, cfg, profile)


def _base_for(source: str, cfg: EngineConfig, target: LoadedModel) -> LoadedModel:
    if source in (cfg.target.resolved_source, target.source):
        return target
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    base = load_model(source, dtype=DTYPES[resolve_dtype(cfg.target.dtype, target.model.device.type)],
                      cache_dir=cache, trust_remote_code=cfg.trust_remote_code)
    base.model.to(target.model.device)  # the draft runs where its target does
    return base


def calibration_path(cfg: EngineConfig) -> Path | None:
    """The target's calibration profile: an explicit path, or (`auto`) the one committed with the draft, if any."""
    choice = cfg.target.calibration
    if choice in (None, "", "off") or cfg.spec.mode == "ar":
        return None
    if choice != "auto":
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"calibration profile {choice} does not exist")
        return path
    directory = draft_dir(cfg.draft.source)
    if directory is None:
        return None
    # Costs (hence the best draft length) depend on the dtype: a profile for this dtype first, then the generic one.
    name = Path(cfg.target.resolved_source).name
    for file in (f"{name}.{resolve_dtype(cfg.target.dtype)}.json", f"{name}.json"):
        path = directory / "calibration" / file
        if path.is_file():
            return path
    return None


def load_profile(cfg: EngineConfig) -> dict | None:
    path = calibration_path(cfg)
    if path is None:
        return None
    try:
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"calibration profile {path} is not readable JSON: {exc}") from exc
    return for_machine(profile, machine_name(default_device().type), str(path))  # this machine's costs


def effective_spec(cfg: EngineConfig, profile: dict | None) -> SpecConfig:
    """SpecConfig with the profile's draft-length policy where the user did not set one (explicit settings win)."""
    if profile is None or cfg.spec.fixed_exit is not None:
        return cfg.spec
    given = cfg.spec.model_fields_set
    update = {f: profile[f] for f in PROFILE_SPEC_FIELDS if f in profile and f not in given}
    return cfg.spec.model_copy(update=update) if update else cfg.spec


def apply_exits(draft: SortedDraft, cfg: EngineConfig, profile: dict | None) -> SortedDraft:
    """Mode exit:L, config overrides, then the per-target calibration profile decide exits and thresholds."""
    fixed = cfg.spec.fixed_exit
    if fixed is not None:
        if fixed > draft.spec.num_layers:
            raise ConfigError(f"exit:{fixed} is deeper than the draft's {draft.spec.num_layers} layers")
        return draft.with_exits([fixed], [0.0])
    exits = cfg.draft.exit_layers or draft.spec.exit_layers
    thresholds = cfg.draft.thresholds
    if thresholds is None and profile is not None and profile.get("exit_layers", exits) == exits:
        thresholds = profile["thresholds"]
    if thresholds is None and exits == draft.spec.exit_layers:
        thresholds = draft.spec.thresholds
    if exits == draft.spec.exit_layers and thresholds == draft.spec.thresholds:
        return draft
    if exits[-1] > draft.spec.num_layers:
        raise ConfigError(f"exit {exits[-1]} is deeper than the draft's {draft.spec.num_layers} layers")
    return draft.with_exits(exits, thresholds)


def make_policy(spec: SpecConfig) -> DraftLengthPolicy:
    return HeuristicK(start=spec.k, max_k=spec.max_k) if spec.policy == "heuristic" else FixedK(spec.k)


def make_speculation(spec: SpecConfig, drafter: Any | None, profile: dict | None,
                     suffix: SuffixStore | None = None) -> tuple[Any | None, SpeculationBudget | None]:
    """Wrap the draft model's drafter (in-process or a Ray handle client) for trees, lookup and the store of earlier
    outputs (`suffix`), and size rounds from the profile's measured costs when the policy is `auto`. Plain chains
    with a k policy come back unchanged."""
    costs = CostModel.from_profile(profile) if spec.policy == "auto" and profile else None
    if spec.policy == "auto" and costs is None:
        logger.warning("policy auto needs a calibration profile with costs; using a fixed k=%d", spec.k)
    if spec.mode == "ar" or not (spec.trees or suffix is not None):
        return drafter, None
    lookup = spec.lookup or spec.mode == "lookup"
    shape = TreeShape(width=spec.width if spec.uses_draft_model else 1, lookup=lookup, max_nodes=spec.max_nodes,
                      frontier=spec.frontier)
    finder = PromptLookup(spec.lookup_ngram, spec.lookup_tokens, spec.lookup_candidates,
                          spec.lookup_branch_tokens) if lookup else None
    drafter = TreeDrafter(drafter if spec.uses_draft_model else None, finder, spec.lookup_alone, suffix)
    return drafter, SpeculationBudget(shape, costs, spec.max_k)


def warn_if_modelled_slower(cfg: EngineConfig, profile: dict | None) -> None:
    """Say so when the target's own calibration found no setting that beats plain decoding where it was measured."""
    modelled = (profile or {}).get("modelled", {}).get("speedup")
    if modelled is not None and modelled < 1.0 and cfg.spec.mode == "s2d":
        logger.warning("calibration %s models S2D at %.2fx plain decoding for %s (measured with %s); `--mode ar` may "
                       "be faster here", calibration_path(cfg), modelled, cfg.target.name,
                       profile.get("measured_with", "fp32, 1 thread"))


def build_verifier(model: torch.nn.Module, cfg: EngineConfig | None = None, kernels: Kernels | None = None,
                   cuda_graphs: bool | None = None, prefix_cache: PrefixCacheSpec | None = None,
                   lora: LoraBank | None = None) -> TargetVerifier:
    """The target's verifier, the one way it is made: `cfg`'s kernels (threads included), CUDA graphs and prefix
    cache; without a config (a measurement of one mechanism), the default kernels and no prefix cache. `kernels`,
    `cuda_graphs` and `prefix_cache` override them for callers that measure one backend or cannot capture graphs (a
    TP rank's all-reduces). `lora`: the adapters its rows may name (core/lora.py)."""
    kept = cfg.prefix_cache.spec() if cfg is not None else None
    cfg = cfg if cfg is not None else EngineConfig()
    check_deterministic_device(cfg, model.lm_head.weight.device if hasattr(model, "lm_head") else "cpu")
    return TargetVerifier(model, cuda_graphs=cfg.cuda_graphs if cuda_graphs is None else cuda_graphs,
                          kernels=kernels if kernels is not None else make_kernels(cfg),
                          prefix_cache=prefix_cache if prefix_cache is not None else kept, lora=lora,
                          mix_prompts=cfg.prompt_round_tokens > 0)


def build_drafter(draft: SortedDraft, cfg: EngineConfig | None = None, cuda_graphs: bool | None = None,
                  prefix_cache: PrefixCacheSpec | None = None) -> SortedDrafter:
    """The sorted draft's drafter, the one way it is made: `cfg`'s stop confidence, CUDA graphs and prefix cache
    (its kernels, threads included, are the draft's own: build_draft); without a config, the defaults and no prefix
    cache. Overrides as in build_verifier."""
    kept = cfg.prefix_cache.spec() if cfg is not None else None
    cfg = cfg if cfg is not None else EngineConfig()
    return SortedDrafter(draft, cfg.draft.stop_confidence,
                         cuda_graphs=cfg.cuda_graphs if cuda_graphs is None else cuda_graphs,
                         prefix_cache=prefix_cache if prefix_cache is not None else kept)


def make_engine(verifier: Verifier, drafter: Any | None = None, **options: Any) -> SpecEngine:
    """An engine over given collaborators with explicit options (SpecEngine's: policy, budget, max_context, ...):
    what benchmarks of one mechanism use; entry points use assemble_engine / build_engine."""
    return SpecEngine(verifier, drafter, **options)


@dataclass
class Built:
    """Everything an entry point needs: the engine plus the pieces it was made of."""

    engine: SpecEngine
    target: LoadedModel
    draft: SortedDraft | None
    cfg: EngineConfig


def assemble_engine(cfg: EngineConfig, verifier: Verifier, drafter: Drafter | None, profile: dict | None,
                    max_context: int | None, detokenize: Callable[[list[int]], str] | None,
                    plain_steps: int = 1, detokenize_whole: bool = False) -> SpecEngine:
    """The one way an engine is made from its collaborators (in-process models, or the router's Ray clients): the
    draft-length policy from the config and the profile, and a warning when the profile models S2D slower.
    `plain_steps`: greedy steps per verifier call in rounds without draft tokens (a served target sets it, since
    each call costs a round trip). `detokenize_whole`: the decoder rewrites text across token edges, so stop strings
    are searched in whole decodes (SpecEngine)."""
    spec = effective_spec(cfg, profile)
    warn_if_modelled_slower(cfg, profile)
    # One store per engine, so per target: earlier outputs never cross models. Plain decoding (`ar`) keeps none.
    store_spec = cfg.suffix.spec() if spec.mode != "ar" else None
    suffix = SuffixStore(store_spec) if store_spec is not None else None
    drafter, budget = make_speculation(spec, drafter, profile, suffix)
    logger.info("engine: target=%s mode=%s policy=%s k=%d width=%d lookup=%s suffix=%s", cfg.target.name,
                cfg.spec.mode, spec.policy, spec.k, spec.width, spec.lookup, store_spec)
    return make_engine(verifier, drafter, policy=make_policy(spec), max_context=max_context, detokenize=detokenize,
                       budget=budget, plain_steps=plain_steps, suffix=suffix, prompt_tokens=cfg.prompt_round_tokens,
                       detokenize_whole=detokenize_whole)


def build_engine(cfg: EngineConfig, target: LoadedModel | None = None, plain_steps: int = 1) -> Built:
    cfg = with_resolved_dtype(cfg, default_device().type)
    check_deterministic_device(cfg, target.model.device if target is not None else default_device())
    set_threads(cfg.num_threads)
    target = target or load_target(cfg)
    profile = load_profile(cfg)
    draft = build_draft(cfg, target, profile) if cfg.spec.uses_draft_model else None
    if draft is not None:
        logger.info("draft %s: exits=%s thresholds=%s", cfg.draft.source, draft.spec.exit_layers,
                    draft.spec.thresholds)
    tok = target.tokenizer
    engine = assemble_engine(
        cfg, build_verifier(target.model, cfg), build_drafter(draft, cfg) if draft is not None else None, profile,
        max_context=context_window(cfg.target.max_context, target.model.config.to_dict()),
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
        plain_steps=plain_steps, detokenize_whole=bool(getattr(tok, "clean_up_tokenization_spaces", False)),
    )
    return Built(engine, target, draft, cfg)
