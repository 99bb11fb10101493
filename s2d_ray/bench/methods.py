"""The decoding methods a benchmark compares: one small class each, behind one call.

`generate(prompt_ids, max_new_tokens, params) -> (token_ids, MethodStats)`; adding a method is adding a class.
Engine methods (`ar`, `exit:<L>`, `s2d`) go through `build_engine`, never a copy of the decode loop. The transformers
baselines call `model.generate` exactly as a user would (greedy: do_sample=False, use_cache=True).
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from ..build import DTYPES, build_draft, build_engine, load_profile
from ..config import EngineConfig, SpecConfig
from ..kernels import stock_attention
from ..core.draft import SortedDraft
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..errors import ConfigError
from ..models import LoadedModel

logger = logging.getLogger(__name__)


@dataclass
class MethodStats:
    """What one generation cost besides wall time. None means the method cannot tell."""

    num_target_forwards: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None
    exit_histogram: dict[str, int] = field(default_factory=dict)  # exit layer -> draft tokens proposed there
    draft_seconds: float | None = None
    target_seconds: float | None = None
    source: str = "definition"  # "engine" (its own metrics) | "counted" (forward hooks) | "definition"


class Method(Protocol):
    name: str
    lossless: bool  # greedy output must equal plain decoding's

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams) -> tuple[list[int], MethodStats]: ...


# --- transformers baselines --------------------------------------------------------------------------------------
class ForwardCounter:
    """Counts forward calls and fed tokens of a model through a pre-hook that lives only inside the `with`."""

    def __init__(self, model: nn.Module, role_of=None) -> None:
        self.model, self.role_of = model, role_of or (lambda _module: "target")
        self.calls: Counter[str] = Counter()
        self.fed: Counter[str] = Counter()

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        role = self.role_of(module)
        self.calls[role] += 1
        self.fed[role] += int(ids.shape[-1]) if ids is not None else 0

    def __enter__(self) -> "ForwardCounter":
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def sampling_kwargs(params: SamplingParams) -> dict:
    if params.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}


class HFGenerate:
    """Plain transformers `generate` (the Spec-Bench "plain decoding" baseline); subclasses add assistant kwargs."""

    name = "hf-generate"
    lossless = True

    def __init__(self, model: nn.Module, eos_token_id: int | None) -> None:
        self.model, self.eos = model, eos_token_id

    def _extra_kwargs(self) -> dict:
        return {}

    def _call(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> list[int]:
        ids = torch.tensor([prompt_ids])
        if params.seed is not None:
            torch.manual_seed(params.seed)
        with torch.no_grad(), stock_attention(self.model, self._extra_kwargs().get("assistant_model")):
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
                use_cache=True, eos_token_id=self.eos, pad_token_id=self.eos, **sampling_kwargs(params),
                **self._extra_kwargs(),
            )
        return out[0, len(prompt_ids):].tolist()

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams) -> tuple[list[int], MethodStats]:
        tokens = self._call(prompt_ids, max_new_tokens, params)
        return tokens, MethodStats(num_target_forwards=len(tokens))  # one forward per token, no hooks in the way


class HFCandidateMethod(HFGenerate):
    """Assisted decoding in transformers: target forwards are counted; drafted/accepted follow from them.

    After the first (prompt + candidates) forward each verification feeds 1 + c tokens for c candidates, so
    drafted = fed - prompt - (forwards - 1) and accepted = generated - forwards (one target token per forward).
    """

    draft_exit: int | None = None

    def _role(self, module: nn.Module) -> str:
        return "target"

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams) -> tuple[list[int], MethodStats]:
        with ForwardCounter(self.model, self._role) as counter:
            tokens = self._call(prompt_ids, max_new_tokens, params)
        forwards = counter.calls["target"]
        drafted = max(counter.fed["target"] - len(prompt_ids) - (forwards - 1), 0)
        accepted = min(max(len(tokens) - forwards, 0), drafted)
        hist = {str(self.draft_exit): drafted} if self.draft_exit and drafted else {}
        return tokens, MethodStats(forwards, drafted, accepted, hist, source="counted")


class HFAssisted(HFCandidateMethod):
    """`generate(assistant_model=...)` with the draft's deepest exit as a standalone causal LM.

    `schedule=None` keeps transformers' assistant defaults (what a user gets: 20 tokens, constant schedule, dynamic
    confidence stop 0.4); "heuristic" matches the engine's policy (start at k, +2 / -1 reset per request, no stop).
    """

    lossless = True

    def __init__(self, model: nn.Module, eos_token_id: int | None, assistant: nn.Module, exit_layer: int,
                 schedule: str | None = None, k: int = 5) -> None:
        super().__init__(model, eos_token_id)
        self.assistant, self.draft_exit = assistant, exit_layer
        self.name = "hf-assisted" if schedule is None else f"hf-assisted:{schedule}"
        if schedule == "heuristic":  # per-request reset, as the engine's policy does
            gc = self.assistant.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "heuristic_transient"
            gc.assistant_confidence_threshold = 0.0
        elif schedule is not None:
            raise ConfigError(f"hf-assisted takes no option or `:heuristic`, got {schedule!r}")

    def _extra_kwargs(self) -> dict:
        return {"assistant_model": self.assistant}


class HFEarlyExit(HFCandidateMethod):
    """transformers self-speculative decoding: the target's first `layer` layers + its head draft (no training)."""

    def __init__(self, model: nn.Module, eos_token_id: int | None, layer: int) -> None:
        super().__init__(model, eos_token_id)
        self.layer = self.draft_exit = layer
        self.full_layers = model.config.num_hidden_layers
        self.name = f"hf-early-exit:{layer}"

    def _role(self, module: nn.Module) -> str:
        base = getattr(module, module.base_model_prefix)
        return "draft" if base.config.num_hidden_layers < self.full_layers else "target"

    def _extra_kwargs(self) -> dict:
        return {"assistant_early_exit": self.layer}

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams) -> tuple[list[int], MethodStats]:
        # transformers lowers config.num_hidden_layers while drafting and restores it without try/finally; an
        # interrupted call would leave the shared target running on `layer` layers for every later method.
        base = getattr(self.model, self.model.base_model_prefix)
        try:
            return super().generate(prompt_ids, max_new_tokens, params)
        finally:
            base.config.num_hidden_layers = self.full_layers


class HFPromptLookup(HFCandidateMethod):
    """transformers prompt-lookup decoding: n-gram matches in the prompt are the candidates."""

    def __init__(self, model: nn.Module, eos_token_id: int | None, num_tokens: int = 10) -> None:
        super().__init__(model, eos_token_id)
        self.num_tokens = num_tokens
        self.name = "hf-prompt-lookup"

    def _extra_kwargs(self) -> dict:
        return {"prompt_lookup_num_tokens": self.num_tokens}


class SubVocabHead(nn.Module):
    """A reduced-vocabulary draft head as an HF `lm_head`: the draft's own rows for its token subset, -inf elsewhere
    (exactly what the engine's drafter proposes from), so an assistant built from the draft is the same draft."""

    def __init__(self, stack) -> None:
        super().__init__()
        self.stack = stack

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return self.stack.head_logits(normed)


def standalone_draft(draft: SortedDraft, target_config, exit_layer: int | None = None) -> nn.Module:
    """The draft up to one exit as a plain HF causal LM sharing the draft's modules (no weights copied)."""
    from transformers import AutoModelForCausalLM

    exit_layer = exit_layer or draft.spec.exit_layers[-1]
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = exit_layer
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg)
    parts, base = draft.parts, lm.model
    head = parts.head if draft.vocab_ids is None else SubVocabHead(draft.stack)
    base.embed_tokens, base.norm, base.rotary_emb, lm.lm_head = parts.embed, parts.norm, parts.rotary, head
    base.layers = nn.ModuleList(list(draft.layers)[:exit_layer])
    if any(p.is_meta for p in lm.parameters()) or any(b.is_meta for b in lm.buffers()):
        raise ConfigError("the draft could not be turned into a standalone model (a module was not shared)")
    return lm.eval()


# --- the engine --------------------------------------------------------------------------------------------------
class EngineMethod:
    """One engine built by `build_engine` in a mode (`ar`, `exit:<L>`, `s2d`); stats from its own metrics."""

    lossless = True

    def __init__(self, cfg: EngineConfig, target: LoadedModel, eos_token_id: int | None) -> None:
        self.name = cfg.spec.mode
        self.built = build_engine(cfg, target=target)
        self.eos = (eos_token_id,) if eos_token_id is not None else ()
        self._n = 0

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams) -> tuple[list[int], MethodStats]:
        self._n += 1
        req = GenerationRequest(f"bench-{self._n}", list(prompt_ids), max_new_tokens, params, self.eos)
        res = self.built.engine.generate([req])[0]
        m = res.metrics
        return res.token_ids, MethodStats(
            m["num_target_forwards"], m["num_draft_tokens"], m["num_accepted_draft_tokens"],
            dict(m["exit_histogram"]), m["draft_seconds"], m["target_seconds"], source="engine",
        )


def with_mode(cfg: EngineConfig, mode: str) -> EngineConfig:
    """The same config in another speculation mode (validated, so a bad `exit:` fails here)."""
    SpecConfig(mode=mode)  # validates the mode; the copy keeps which fields the user set (profiles fill the rest)
    return cfg.model_copy(update={"spec": cfg.spec.model_copy(update={"mode": mode})})


# --- construction from names ---------------------------------------------------------------------------------------
ENGINE_PREFIXES = ("ar", "s2d", "exit:", "lookup")


def parse_shape(shape: str) -> dict:
    """`s2d:<shape>` rows force speculation settings over the profile's, `+`-joined: `chain` (width 1, no lookup),
    `tree` / `tree<W>` (width 4 / W), `lookup`, `nolookup`, `auto` / `fixed` / `heuristic` (policy), `k<N>`, `n<N>`
    (max nodes), `f<N>` (frontier nodes expanded per depth), `lc<N>` (lookup continuations), `lb<N>` (tokens per
    lookup branch). `lookup:<shape>` rows take the lookup parts; `exit:<L>:<shape>` rows the same at one fixed exit."""
    out: dict = {}
    for part in shape.split("+"):
        if part == "chain":
            out.update(width=1, lookup=False)
        elif part.startswith("tree"):
            out["width"] = int(part[4:] or 4)
        elif part in ("lookup", "nolookup"):
            out["lookup"] = part == "lookup"
        elif part in ("auto", "fixed", "heuristic"):
            out["policy"] = part
        elif part[:2] in ("lc", "lb") and part[2:].isdigit():
            out[{"lc": "lookup_candidates", "lb": "lookup_branch_tokens"}[part[:2]]] = int(part[2:])
        elif part[:1] in ("k", "n", "f") and part[1:].isdigit():
            out[{"k": "k", "n": "max_nodes", "f": "frontier"}[part[0]]] = int(part[1:])
        else:
            raise ConfigError(f"unknown shape part {part!r} in s2d:{shape}")
    return out


def default_method_names(exit_layers: list[int]) -> list[str]:
    return (["hf-generate", "ar", "hf-assisted", "hf-assisted:heuristic", f"hf-early-exit:{exit_layers[-1]}",
             "hf-prompt-lookup"] + [f"exit:{e}" for e in exit_layers] + ["s2d"])


def make_methods(names: list[str], cfg: EngineConfig, target: LoadedModel) -> list[Method]:
    """Methods by name, all on the same loaded target; the draft is built once per target."""
    eos = target.tokenizer.eos_token_id
    drafts: list[SortedDraft] = []

    def draft() -> SortedDraft:
        if not drafts:
            drafts.append(build_draft(cfg, target, load_profile(cfg)))
        return drafts[0]

    methods: list[Method] = []
    for name in names:
        head, _, arg = name.partition(":")
        if name == "hf-generate":
            methods.append(HFGenerate(target.model, eos))
        elif head == "hf-assisted":
            assistant = standalone_draft(draft(), target.model.config)
            methods.append(HFAssisted(target.model, eos, assistant, draft().spec.exit_layers[-1],
                                      schedule=arg or None, k=cfg.spec.k))
        elif head == "hf-early-exit":
            methods.append(HFEarlyExit(target.model, eos, int(arg) if arg else draft().spec.exit_layers[-1]))
        elif name == "hf-prompt-lookup":
            methods.append(HFPromptLookup(target.model, eos))
        elif head == "hf-generate" and arg in DTYPES:
            other = HFGenerate(copy.deepcopy(target.model).to(DTYPES[arg]), eos)
            other.name = name
            methods.append(other)
        elif name in ("ar", "s2d", "lookup") or (head == "exit" and ":" not in arg):
            methods.append(EngineMethod(with_mode(cfg, name), target, eos))
        elif head in ("s2d", "lookup", "exit") and arg:
            # exit:<L>:<shape> is the fixed-exit twin of s2d:<shape> (the adaptive exits against each single one,
            # on the same tree and lookup settings)
            layer, _, shape = arg.partition(":") if head == "exit" else ("", "", arg)
            spec = with_mode(cfg, f"exit:{layer}" if layer else head).spec.model_copy(update=parse_shape(shape))
            method = EngineMethod(cfg.model_copy(update={"spec": spec}), target, eos)
            method.name = name
            methods.append(method)
        else:
            raise ConfigError(f"unknown method {name!r}; known: hf-generate[:<dtype>], ar, s2d, s2d:<shape> (e.g. "
                              "s2d:tree4+lookup+auto+k2+n12, s2d:chain), lookup, exit:<L>[:<shape>], "
                              "hf-assisted[:heuristic], hf-early-exit[:<L>], hf-prompt-lookup")
    return methods
