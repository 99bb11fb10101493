"""Every user-facing setting as a pydantic model: defaults live here and nowhere else; errors say what to change."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .core.prefix_cache import PrefixCacheSpec
from .core.suffix import SuffixSpec
from .errors import ConfigError

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-s2d"  # the committed sorted draft (s2d_ray/assets/drafts)
MODE_PATTERN = re.compile(r"^(ar|s2d|lookup|exit:\d+)$")
# The data directory (train/, spec_bench/, gsm8k_test_dev/ ...) is a setting, S2D_DATA_DIR, with no default: a
# command that needs data and got no path names the flag and the variable to set. Profiles record data paths
# relative to it, so they hold no machine's absolute paths.
DATA_ENV = "S2D_DATA_DIR"
DATA_DIR: Path | None = Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else None
TRAIN_DATA = "train/instructions.jsonl"  # instruction rows: training, self-distillation, calibration (held-out split)
GSM8K_TEST = "gsm8k_test_dev/test_dev.jsonl"  # held-out GSM8K problems
SPEC_BENCH_QUESTIONS = "spec_bench/question.jsonl"  # Spec-Bench's question file


def context_window(max_context: int | None, model_config: dict, cap: int | None = None) -> int | None:
    """A target's context window, the one rule everything sizes by: the configured `max_context`, else the model's
    `max_position_embeddings` (a multimodal config's text part too), capped by `cap` (the served limit); None when
    neither is known and nothing caps it."""
    own = model_config.get("max_position_embeddings") or model_config.get("text_config", {}).get(
        "max_position_embeddings")
    window = max_context or (int(own) if own else None) or cap
    return min(window, cap) if window is not None and cap is not None else window


DType = Literal["auto", "float32", "bfloat16", "float16", "float64"]
LinearKernel = Literal["auto", "several", "stock", "packed"]
LINEAR_KERNEL_HELP = (
    "CPU projections: `auto` runs weights packed once where that measured faster per shape (oneDNN for several rows, "
    "MKL for one row), `several` the several-row choice only, `stock` torch's F.linear everywhere, `packed` every "
    "projection packed both ways where the dtype allows. $S2D_LINEAR_KERNEL overrides it."
)
KERNEL_TIMES_HELP = (
    "File keeping the least time each CPU kernel candidate took on this machine, which load-time kernel choices "
    "decide on (a replica loading beside busy neighbours keeps a quiet process's choice); default "
    "<cache dir>/kernel_times.json, `off`: this process's measurement alone. $S2D_KERNEL_TIMES overrides it."
)


def data_file(relative: str, flag: str | None = None) -> Path:
    """`relative` under the data directory; without S2D_DATA_DIR, a ConfigError that says what to set or pass."""
    if DATA_DIR is None:
        raise ConfigError(f"no data directory: set {DATA_ENV} (it holds {relative})"
                          + (f" or pass {flag}" if flag else ""))
    return DATA_DIR / relative


def optional_data_file(relative: str) -> Path | None:
    """`relative` under the data directory if it is set and the file exists, else None (callers fall back)."""
    path = DATA_DIR / relative if DATA_DIR is not None else None
    return path if path is not None and path.is_file() else None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftConfig(_Strict):
    source: str = Field(
        DEFAULT_DRAFT,
        description="A draft directory, a committed draft name, or `cut:<model>:<layers>` for an untrained cut "
        "of the first layers of <model>.",
    )
    exit_layers: list[int] | None = Field(None, description="Override the draft's exits (increasing layer numbers).")
    thresholds: list[float] | None = Field(
        None, description="Confidence threshold tau per exit; the last exit always emits. Default: the draft's own, "
        "else the per-target calibration profile, else the paper's (0.5, ..., 0)."
    )
    stop_confidence: float = Field(0.0, ge=0.0, le=1.0, description="Stop drafting once q(token) falls below this.")

    @model_validator(mode="after")
    def _exits_and_thresholds(self) -> "DraftConfig":
        ex = self.exit_layers
        if ex is not None and (not ex or any(b <= a for a, b in zip(ex, ex[1:])) or ex[0] < 1):
            raise ValueError(f"exit_layers must be increasing layer numbers >= 1, got {ex}")
        if self.thresholds is not None:
            if any(not 0.0 <= t <= 1.0 for t in self.thresholds):
                raise ValueError("thresholds must lie in [0, 1]")
            if ex is not None and len(self.thresholds) != len(ex):
                raise ValueError(f"give one threshold per exit: {len(ex)} exits, {len(self.thresholds)} thresholds")
        return self


class SpecConfig(_Strict):
    mode: str = Field("s2d", description="`s2d` (adaptive exits), `exit:<layer>` (one fixed exit), `lookup` (prompt "
                      "lookup alone, no draft model) or `ar` (plain decoding).")
    policy: Literal["heuristic", "fixed", "auto"] = Field(
        "heuristic", description="Draft length: `heuristic` (+2 if all accepted, else -1), `fixed` k, or `auto`: "
        "every round, the depth and tree size that maximise modelled tokens/s for the whole batch from the "
        "calibrated cost model (speculation shrinks as load grows, down to plain decoding). `auto` needs a "
        "calibration profile with costs; without one it acts as `fixed`."
    )
    k: int = Field(5, ge=1, le=32, description="Fixed k, or the heuristic's starting k (the tree's spine depth).")
    max_k: int = Field(16, ge=1, le=64, description="Upper bound for the heuristic and auto policies.")
    width: int = Field(1, ge=1, le=16, description="Token tree: the draft's top-`width` tokens at every depth (the "
                       "first continues the spine, the rest are sibling leaves); 1 = a chain.")
    frontier: int = Field(1, ge=1, le=16, description="Token tree: nodes the draft expands per depth, the most "
                          "probable by path probability, in one batched draft forward (EAGLE-2 dynamic trees); 1 = the "
                          "top-1 spine with the other candidates as leaves.")
    lookup: bool = Field(False, description="Add prompt-lookup candidates (n-gram matches in prompt + output) to the "
                         "tree; they cost no forward.")
    lookup_ngram: int = Field(4, ge=1, le=16, description="Longest suffix n-gram lookup matches.")
    lookup_tokens: int = Field(10, ge=1, le=64, description="Most tokens lookup proposes per round.")
    lookup_candidates: int = Field(1, ge=1, le=16, description="Distinct lookup continuations per round: the first "
                                   "from the most recent occurrence of the longest matching suffix, the others from "
                                   "older occurrences and shorter suffixes, as branches of the tree.")
    lookup_branch_tokens: int = Field(3, ge=1, le=64, description="Tokens of each lookup continuation after the first.")
    lookup_alone: int = Field(4, ge=1, le=64, description="A lookup match of at least this many tokens is proposed "
                              "alone, without running the draft model that round.")
    max_nodes: int = Field(24, ge=1, le=128, description="Most tree nodes verified per sequence and round.")

    @property
    def uses_draft_model(self) -> bool:
        return self.mode not in ("ar", "lookup")

    @property
    def trees(self) -> bool:
        """Proposals are token trees of deterministic candidates (also chains sized by the auto policy)."""
        return self.width > 1 or self.lookup or self.mode == "lookup" or self.policy == "auto"

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if not MODE_PATTERN.match(v):
            raise ValueError(f"mode must be `s2d`, `ar`, `lookup` or `exit:<layer>`, got {v!r}")
        return v

    @property
    def fixed_exit(self) -> int | None:
        return int(self.mode.split(":")[1]) if self.mode.startswith("exit:") else None


class TargetConfig(_Strict):
    name: str = Field(DEFAULT_TARGET, description="The model name clients ask for (OpenAI `model`).")
    source: str | None = Field(None, description="Named source, HF directory or .gguf file; default: `name`.")
    dtype: DType = Field(
        "auto", description="Weights dtype; `auto`: bfloat16 where it is the fast path (a CPU with AVX512-BF16 or AMX, "
        "a CUDA GPU with bf16), float32 elsewhere. The calibration profile is the one for the dtype used."
    )
    max_context: int | None = Field(None, ge=8, description="Context limit in tokens; default: the model's.")
    calibration: str | None = Field(
        "auto", description="A per-target profile (JSON) from `s2d calibrate`; `auto`: the profile committed with the "
        "draft for this target, if there is one; null or `off`: none (the draft's or the paper's settings)."
    )

    @property
    def resolved_source(self) -> str:
        return self.source or self.name


class PrefixCacheConfig(_Strict):
    enabled: bool = Field(True, description="Keep the KV of finished sequences by token prefix, so a later prompt "
                          "that starts the same way (a system prompt, an earlier turn) prefills only the rest.")
    max_tokens: int | None = Field(16384, gt=0, description="Most token positions of finished sequences kept per "
                                   "target (and per draft); the least recently used go first. Required when enabled.")

    @model_validator(mode="after")
    def _size(self) -> "PrefixCacheConfig":
        return require_size(self, "prefix_cache")

    def spec(self) -> PrefixCacheSpec | None:
        """What the verifier and drafter are built with (None: off)."""
        return PrefixCacheSpec(self.max_tokens) if self.enabled and self.max_tokens else None


class SuffixConfig(_Strict):
    enabled: bool = Field(False, description="Draft from earlier outputs: keep recent finished outputs and propose "
                          "what followed the longest match of a sequence's last tokens, as token-tree candidates "
                          "beside the draft model and prompt lookup (docs/CACHING.md). Needs max_tokens.")
    max_tokens: int | None = Field(None, gt=0, description="Most tokens of outputs kept per target (all scopes "
                                   "together); the oldest outputs go first. Required when enabled.")
    scope: Literal["global", "api_key"] = Field(
        "api_key", description="Whose outputs a request may draft from, within its tenant (served apps scope the "
        "store by tenant and cache_salt first, tenants.isolation): `api_key` only those of requests with the same "
        "OpenAI `user` / `safety_identifier` (the CLI has one scope), `global` every request's. Output is the same "
        "either way; only speed can differ.")
    max_ngram: int = Field(8, ge=2, le=32, description="Longest suffix compared; also the prompt tokens kept "
                           "before each output, so an output's first tokens can match the end of a prompt.")
    num_tokens: int = Field(16, ge=1, le=64, description="Most tokens proposed per continuation.")
    candidates: int = Field(1, ge=1, le=8, description="Distinct continuations per round (others as branches).")
    alone_ngram: int = Field(8, ge=2, le=64, description="A match at least this long is proposed without running "
                             "the draft model that round.")

    @model_validator(mode="after")
    def _size(self) -> "SuffixConfig":
        return require_size(self, "suffix")

    def spec(self) -> SuffixSpec | None:
        """What the engine's store is built with (None: off)."""
        if not self.enabled or not self.max_tokens:
            return None
        return SuffixSpec(self.max_tokens, self.max_ngram, self.num_tokens, self.candidates, self.alone_ngram)


def require_size(section: BaseModel, name: str) -> BaseModel:
    """A cache or store that is enabled needs its size: refused at build, naming the field."""
    if section.enabled and section.max_tokens is None:
        raise ValueError(f"{name}.max_tokens is required when {name}.enabled is true")
    return section


DETERMINISTIC_HELP = ("Batch-invariant kernels (kernels/deterministic.py): every position's logits equal a one-token "
                      "decode step's bit for bit, so greedy output equals plain greedy decoding in this mode and "
                      "repeats run to run, in bf16 too; slower (linear_kernel is not used).")


class EngineConfig(_Strict):
    """One target + one draft + speculation settings: what `SpecEngine` is built from."""

    target: TargetConfig = TargetConfig()
    draft: DraftConfig = DraftConfig()
    spec: SpecConfig = SpecConfig()
    cache_dir: str | None = Field(None, description="Where converted models live; default $S2D_CACHE_DIR or ~/.cache.")
    trust_remote_code: bool = Field(False, description="Allow models that ship their own code.")
    num_threads: int | None = Field(None, ge=1, description="torch threads; default: all cores.")
    wide_threads: int | None = Field(
        None, ge=1, description="torch threads for wide passes (prompts, token trees, batches: >= 16 positions) "
        "when that is more than num_threads; default: num_threads."
    )
    adaptive_threads: bool = Field(
        True, description="On the CPU, run each pass on the thread count (all, half, one) measured fastest for its "
        "kind and re-time the others now and then: beside a CPU-bound neighbour a pass split over every core waits "
        "for the descheduled thread, on fewer it keeps going. False: num_threads / wide_threads as given."
    )
    cuda_graphs: bool = Field(True, description="On CUDA, replay decode and verify forwards as CUDA graphs by shape "
                              "bucket (an eager GPU step is bound by kernel launches); no effect on the CPU.")
    linear_kernel: LinearKernel = Field("auto", description=LINEAR_KERNEL_HELP)
    kernel_times: str | None = Field(None, description=KERNEL_TIMES_HELP)
    deterministic: bool = Field(False, description=DETERMINISTIC_HELP)
    prompt_round_tokens: int = Field(
        128, ge=0, description="Prompt positions a round carries beside running streams: a longer prompt fills over "
        "several rounds, its chunks in the same target forward as the decode and verify positions, so it does not "
        "stall them (with a calibration the cost grid may lower it, so a round costs at most about two plain steps). "
        "A served plain round keeps its greedy steps per call while prompts fill (the filling row's first token "
        "waits for them). 0: every prompt fills whole in the round it joins, in forwards of its own, and that round "
        "is one pass for everyone (the first token does not wait)."
    )
    prefix_cache: PrefixCacheConfig = Field(PrefixCacheConfig(), description="Prefix cache across requests.")
    suffix: SuffixConfig = Field(SuffixConfig(), description="Drafting from earlier outputs (off by default).")


class SamplingConfig(_Strict):
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
