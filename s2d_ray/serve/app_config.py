"""The serving configuration: which targets, the one shared draft, limits and access, as one validated pydantic model.

`build_app(args)` validates `args` (the `args:` block of a Serve YAML) with `AppConfig.model_validate`, so every
mistake is reported at `serve run` / `serve deploy` time, naming the field. Each deployment's Serve options are
serve/deployment_options.py's; what fits in a replica's memory (KV rows from the model files and the host's RAM or the
device's memory) is serve/sizing.py's, mixed into `TargetSpec` and `AppConfig` and checked when the app validates.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

from ..config import (
    DEFAULT_TARGET, DETERMINISTIC_HELP, KERNEL_TIMES_HELP, LINEAR_KERNEL_HELP, DraftConfig, DType, EngineConfig,
    LinearKernel, SpecConfig, TargetConfig, PrefixCacheConfig, SuffixConfig,
)
from ..hardware import resolve_dtype
from .deployment_options import (
    IN_LOOP_ENV, SERVE_TARGET_ONGOING, BatchOptions, DeploymentOptions, RouterOptions, StrictModel, router_ceiling,
)
from .lora_config import LoraTargetConfig
from .sizing import AppSizing, TargetSizing


class TargetSpec(TargetConfig, DeploymentOptions, BatchOptions, TargetSizing):
    """One target deployment: the model (TargetConfig), its Serve options and tensor parallelism."""

    tp_size: int = Field(1, ge=1, le=64, description="DeepSpeed AutoTP ranks (Ray actors in the replica's group).")
    tp_worker_cpus: float = Field(0.5, ge=0, description="Logical CPUs per TP worker actor.")
    tp_worker_gpus: float = Field(0.0, ge=0, description="GPUs per TP worker actor (1 on GPU nodes).")
    tp_worker_resources: dict[str, float] = Field(default_factory=dict, description="Custom resources per TP worker.")
    tp_init_timeout_s: float = Field(
        600.0, gt=0, description="Loading + init_inference of the whole group must finish within this."
    )
    max_concurrent_sequences: int | None = Field(
        None, ge=1, description="Sequences decoded together for this target; default: limits.max_concurrent_sequences."
    )
    failover_s: float = Field(
        60.0, ge=0, description="When the replica holding a round's call is lost (its process or node died, its TP "
        "group broke), the router resends the call to whichever replica answers (a survivor, or the replacement Serve "
        "starts elsewhere), which rebuilds the sequences' KV from their tokens: streams go on exactly. After this "
        "long without an answer, or when no replica takes a new request's call in this long, the requests fail with "
        "503 and Retry-After. Allow for Serve to start a replica on another node (a TP group: its init). 0: no resend."
    )
    chat_template: str | None = Field(
        None, description="Chat template for this target's /v1/chat/completions: a Jinja template, or the path of a "
        "file holding one; default: the tokenizer's own (a model that ships none answers chat requests with a 400)."
    )
    memory_fraction: float | None = Field(
        None, gt=0, le=1, description="Size the KV cache from memory: this share of the device's memory (of host RAM "
        "on the CPU; per rank with tp_size > 1), less the weights, holds max_slots-long rows; rows = min(that, "
        "max_live_sequences), and the routers admit at most that many sequences at once (the rest queue). Too "
        "little for one full-length row is an error at deploy time. Unset: max_live_sequences rows, unchecked."
    )
    device_memory_gib: float | None = Field(
        None, gt=0, description="Memory of the device each replica (each TP rank) runs on, for sizing at build time "
        "(`serve build`, `serve deploy`, the routers' admission) where no such device is visible; the replica sizes "
        "itself from its own device when it starts. Unset: host RAM for CPU targets; GPU targets are sized on the "
        "replica only."
    )
    plain_steps: int = Field(
        4, ge=1, le=64, description="Greedy tokens per target call in a round where no row has draft tokens (`mode: "
        "ar`, every request `speculate: false`, or drafting switched off for the round by the load-aware budget): "
        "each call costs a Ray round trip, so a plain row takes up to this many of the target's own argmax steps per "
        "call. Same tokens; they stream in bursts, and a new request waits up to this many steps to join. The round "
        "that fills a prompt is one pass with `prompt_round_tokens: 0` (its first token does not wait); with prompt "
        "chunks the running rows keep their steps in it. 1: one step per call. Tensor-parallel "
        "targets always take one (their ranks step in lockstep)."
    )
    placement: Literal["deployment", "router"] = Field(
        "deployment", description="`deployment`: the target is a Serve deployment of its own (replicas, autoscaling, "
        "tensor parallelism), verified over one Ray call per round. `router`: each router replica loads the model and "
        "verifies on the router's model thread, as `draft.placement: router` does for the draft: no call per round "
        "(the latency path of one machine, where the call is a sizeable share of a round at low concurrency). The "
        "target then scales with the router (each router replica holds a copy), takes tp_size 1, and its deployment "
        "options (replicas, autoscaling, num_cpus) do not apply: size `router.num_cpus` for its work."
    )

    lora: LoraTargetConfig | None = Field(
        None, description="Serve LoRA adapters over this target's model, each its own model name, verified in the "
        "same forwards (docs/SERVING.md, 'LoRA targets'); with tp_size > 1 each rank holds its shard of them.")

    @model_validator(mode="after")
    def _tp_dtype(self) -> "TargetSpec":
        if self.tp_size > 1 and self.dtype == "float64":
            raise ValueError(f"target {self.name}: DeepSpeed AutoTP does not support float64; use float32 or bfloat16")
        return self

    @model_validator(mode="after")
    def _placed_target_has_no_deployment(self) -> "TargetSpec":
        if self.placement != "router":
            return self
        if self.tp_size > 1:
            raise ValueError(f"target {self.name}: placement: router loads the whole model in the router's process; "
                             "a tensor-parallel target (tp_size > 1) needs placement: deployment")
        given = sorted(set(DeploymentOptions.model_fields) & self.model_fields_set)
        if given:
            raise ValueError(f"target {self.name}: with placement: router the target runs in the router's process: "
                             f"{', '.join(given)} would not apply (set the router's)")
        return self

    @property
    def device(self) -> str:
        """Where the model runs: "cuda" when its replica (or, with tp_size > 1, its ranks) reserve GPUs, through
        num_gpus or ray_actor_options.num_gpus."""
        gpus = self.tp_worker_gpus if self.tp_size > 1 else self.actor_options().get("num_gpus", 0)
        return "cuda" if (gpus or 0) > 0 else "cpu"

    def placement_group(self) -> dict[str, Any]:
        """Placement group options for a TP replica: bundle 0 is the replica, bundles 1..N its ranks (one node)."""
        if self.tp_size == 1:
            return {}
        replica = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        worker = {"CPU": self.tp_worker_cpus, "GPU": self.tp_worker_gpus, **self.tp_worker_resources}
        bundles = [{k: v for k, v in b.items() if v} for b in [replica] + [worker] * self.tp_size]
        return {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}


class DraftDeploymentConfig(DraftConfig, DeploymentOptions, BatchOptions):
    """The ONE sorted draft every target shares (one tokenizer family), and how the router treats its failures."""

    dtype: DType = Field("auto", description="Draft weights dtype; `auto` as for targets (resolved for this replica).")
    placement: Literal["deployment", "router"] = Field(
        "deployment", description="`deployment`: the draft is its own Serve deployment (its own replicas and "
        "autoscaling, shared by every router replica). `router`: each router replica loads the draft and runs it on "
        "the router's model thread (still shared by all of that router's targets, and their rounds still merge into "
        "one forward): a drafting round makes one call fewer. The draft's deployment options (replicas, "
        "autoscaling, num_cpus) then do not apply: size `router.num_cpus` for the draft's work."
    )
    base_model: str | None = Field(
        None, description="The model whose embedding, norm, head and tokenizer the draft shares (named source, "
        "directory or hub id); default: the `base_model` its s2d_draft.json records, an absolute path of the "
        "machine that trained it: set this where the weights live elsewhere (e.g. /mnt/models/vicuna-7b-v1.5).")
    call_timeout_s: float = Field(30.0, gt=0, description="Longest wait for a propose call (the first calls', "
                                  "before the draft's speed is measured); later calls wait call_timeout_margin x the "
                                  "measured seconds per drafted position, plus call_timeout_floor_s, up to this. A "
                                  "call past its wait counts as a draft failure.")
    call_timeout_margin: float = Field(4.0, ge=1, description="The derived wait over the draft's measured worst "
                                       "seconds per drafted position (recent calls).")
    call_timeout_floor_s: float = Field(0.5, gt=0, description="Added to the derived wait (transport, the draft's "
                                        "batch window, pauses).")
    retry_after_s: float = Field(
        5.0, ge=0, description="After a draft failure, decode target-only (still lossless) this long, then retry; "
        "doubled after each failure in a row, up to retry_max_s."
    )
    retry_max_s: float = Field(60.0, ge=0, description="Longest target-only spell after failures in a row.")
    batch_wait_timeout_s: float = Field(
        0.05, ge=0, description="Most a batch of propose calls is held open for other targets' rounds. The window "
        "adapts below it: a batch waits only for callers whose next round is predicted (from their measured time "
        "away between rounds) within `batch_wait_fraction` of one measured draft forward, or within this cap for a "
        "caller out of phase (one wait aligns it), and runs as soon as they arrive; one caller alone never waits.",
    )
    batch_wait_fraction: float = Field(
        1.0, ge=0, le=1, description="Share of one measured draft forward a batch may wait for another caller's "
        "predicted round: merging saves that caller a forward of its own, worth about a forward (see BENCHMARKS.md, "
        "draft capacity)."
    )

    @model_validator(mode="after")
    def _placed_draft_has_no_deployment(self) -> "DraftDeploymentConfig":
        given = sorted(set(DeploymentOptions.model_fields) & self.model_fields_set)
        if self.placement == "router" and given:
            raise ValueError(f"with placement: router the draft runs in the router's process: {', '.join(given)} "
                             "would not apply (set the router's)")
        return self


class Limits(StrictModel):
    """Request limits; the defaults keep a 2-core machine responsive."""

    max_concurrent_sequences: int = Field(8, ge=1, description="Sequences decoded together per target.")
    max_queued_requests: int = Field(64, ge=0, description="Requests waiting per target beyond that; more get 429.")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest accepted prompt (tokens).")
    max_total_tokens: int = Field(8192, ge=2, description="Prompt + completion limit (also capped by the context).")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(2048, ge=1, description="Largest max_tokens a request may ask for.")
    request_timeout_s: float = Field(300.0, gt=0, description="A request still running after this is aborted (504).")
    score_timeout_s: float = Field(120.0, gt=0, description="A target verification call slower than this fails (503).")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger HTTP bodies get 413.")
    max_choices: int = Field(16, ge=1, description="Most choices per request (prompts in a batch times n).")
    max_logprobs: int = Field(20, ge=0, description="Largest top-n for logprobs / top_logprobs (OpenAI's is 20).")
    max_prompt_logprobs_tokens: int | None = Field(
        None, ge=1, description="Longest prompt scored for echo / prompt logprobs; None: any prompt max_prompt_tokens "
        "allows (the target reduces the prompt's rows to top-n itself, so only P x logprobs numbers travel).")
    seq_idle_ttl_s: float = Field(
        900.0, gt=0, description="Deployments drop KV of sequences untouched this long (state leaked by a dead router)."
    )
    # Per-request work bounds: each is checked on the request's fields, before the queue, the tokenizer or the
    # grammar compiler see it (a 400 naming the field; serve/request_limits.py).
    max_stop_strings: int = Field(4, ge=0, description="Most stop strings (OpenAI's is 4).")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string (characters).")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids.")
    max_bad_words: int = Field(128, ge=0, description="Most bad_words.")
    max_bad_word_chars: int = Field(128, ge=1, description="Longest bad word (characters).")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries (OpenAI's is 300).")
    max_tools: int = Field(128, ge=0, description="Most tools (OpenAI's is 128).")
    max_schema_bytes: int = Field(
        65536, ge=64, description="Largest JSON size of the schema a grammar is compiled from: all tools together, "
        "response_format's json_schema, or structured_outputs.")
    prepare_share: float = Field(
        0.1, gt=0.0, le=1.0, description="Most of one core a router replica spends preparing heavy requests (schemas, "
        "tools, bad words, long prompts: templates, tokenization, grammar compiles) over time: the next heavy one "
        "starts after a rest in proportion to the last one's cost, so one client's heavy requests slow heavy "
        "admissions, not the streams in flight; light requests are prepared at once (serve/admission.py).")


class TenantsConfig(StrictModel):
    """Tenants of the served app and how far their caches are kept apart (RELIABILITY.md, "Tenants")."""

    keys_file: str | None = Field(
        None, description="YAML or JSON file of API keys by tenant, as sha256 digests (`keys: [{tenant: team-a, "
        "sha256: <hex of sha256(key)>, operator: false}, ...]`); default: $S2D_API_KEYS_FILE. Read once when a router "
        "replica starts. With `api_key` / $S2D_API_KEY too, that key is tenant `default`, an operator.")
    isolation: Literal["tenant", "shared"] = Field(
        "tenant", description="`tenant`: each tenant's requests fork prefix-cache KV and draft from earlier outputs "
        "of that tenant only (a request's `cache_salt` narrows this further). `shared`: every request may use every "
        "request's cached prefixes and outputs (`cache_salt` still separates): faster for a fleet with one tenant, "
        "but a client can then tell from response times and metrics what others sent.")


class AppConfig(StrictModel, AppSizing):
    """Everything `serve run deployments/*.yaml` needs: targets, the shared draft, speculation, limits, access."""

    targets: list[TargetSpec] = Field(
        default_factory=lambda: [TargetSpec(name=DEFAULT_TARGET)], min_length=1,
        description="Target deployments; the request's `model` picks one by name.",
    )
    draft: DraftDeploymentConfig = Field(default_factory=DraftDeploymentConfig, description="The shared draft.")
    spec: SpecConfig = Field(default_factory=SpecConfig, description="Speculation mode and draft-length policy.")
    limits: Limits = Field(default_factory=Limits, description="Request limits.")
    router: RouterOptions = Field(default_factory=RouterOptions, description="Ingress deployment options.")
    api_key: SecretStr | None = Field(
        None, description="Bearer key required on HTTP requests (tenant `default`, an operator); default: "
        "$S2D_API_KEY; unset, and no keys file = open, one tenant."
    )
    tenants: TenantsConfig = Field(default_factory=TenantsConfig, description="API keys by tenant and how far "
                                   "their caches are kept apart.")
    cache_dir: str | None = Field(None, description="Where converted models live; default $S2D_CACHE_DIR or ~/.cache.")
    trust_remote_code: bool = Field(False, description="Allow models that ship their own code.")
    num_threads: int | None = Field(1, ge=1, description="torch threads in each replica and TP worker.")
    serve_in_loop: bool = Field(
        True, description="Run each replica's code, and the routers of the handles it calls, on the replica's own "
        "event loop (Serve's RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, "
        "set per deployment; a value you set there wins): two thread hops fewer per call. Model work stays on each "
        "replica's model thread."
    )
    wide_threads: int | None = Field(
        None, ge=1, description="torch threads for a replica's wide passes (prompts, token trees, batches: passes of "
        ">= 16 positions; tp_size 1); default: num_threads. A round drafts, then verifies: one router's draft and "
        "target passes never run at the same time."
    )
    adaptive_threads: bool = Field(True, description="Wide passes on the thread count measured fastest for them "
                                   "(EngineConfig.adaptive_threads); matters where a replica has more than one.")
    linear_kernel: LinearKernel = Field("auto", description=LINEAR_KERNEL_HELP)
    kernel_times: str | None = Field(None, description=KERNEL_TIMES_HELP)
    deterministic: bool = Field(False, description=DETERMINISTIC_HELP)
    prompt_round_tokens: int = Field(128, ge=0, description="Prompt positions a round carries beside running "
                                     "streams (EngineConfig.prompt_round_tokens; 0: prompts fill whole).")
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig, description="Prefix cache across "
                                            "requests in each target replica (and TP rank) and the draft.")
    suffix: SuffixConfig = Field(default_factory=SuffixConfig, description="Drafting from earlier outputs: one store "
                                 "per target in each router replica (docs/CACHING.md).")

    @model_validator(mode="before")
    @classmethod
    def _rows_follow_admission(cls, data: Any) -> Any:
        """Unset max_live_sequences: the rows a router's rounds need. With fewer rows than the sequences a router
        decodes together, every round reclaims rows its own sequences still use, and each of those recomputes its
        whole context; rows beyond the live sequences keep finished prefixes."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        limits = data.get("limits")
        limits = limits if isinstance(limits, Limits) else Limits.model_validate(limits or {})
        targets = [t.model_dump(exclude_unset=True) if isinstance(t, BaseModel) else dict(t)
                   for t in data.get("targets", [{"name": DEFAULT_TARGET}])]
        floor, admitted = BatchOptions.model_fields["max_live_sequences"].default, 0
        for t in targets:
            decoded = t.get("max_concurrent_sequences") or limits.max_concurrent_sequences
            t.setdefault("max_live_sequences", max(floor, decoded))
            admitted += min(t["max_live_sequences"], decoded)
        draft = data.get("draft") or {}
        draft = draft.model_dump(exclude_unset=True) if isinstance(draft, BaseModel) else dict(draft)
        draft.setdefault("max_live_sequences", max(floor, admitted))
        data.update(targets=targets, draft=draft)
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> "AppConfig":
        names = [t.name for t in self.targets] + [a for t in self.targets if t.lora for a in t.lora.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"target and adapter names must be unique; repeated: {dupes}")
        sharded = [t.name for t in self.targets if t.tp_size > 1]
        if self.deterministic and sharded:  # sharded projections are DeepSpeed's, not the mode's row-chunked ones
            raise ValueError(f"deterministic: true does not cover tensor-parallel targets {sharded}; set tp_size: 1")
        on_gpu = [t.name for t in self.targets if t.device == "cuda"]
        if self.deterministic and on_gpu:  # norms and reductions are not batch-invariant on CUDA yet
            raise ValueError(f"deterministic: true runs on the CPU only; targets {on_gpu} reserve GPUs (set "
                             "deterministic: false, or num_gpus: 0)")
        return self

    def deployment_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Serve options of one of the app's deployments with the app-wide settings in (serve_in_loop)."""
        if not self.serve_in_loop:
            return opts
        actor = dict(opts.get("ray_actor_options") or {})
        runtime_env = dict(actor.get("runtime_env") or {})
        runtime_env["env_vars"] = {**IN_LOOP_ENV, **(runtime_env.get("env_vars") or {})}
        return {**opts, "ray_actor_options": {**actor, "runtime_env": runtime_env}}

    @property
    def uses_draft(self) -> bool:
        """Whether the app runs the sorted draft (`lookup` and `ar` need no draft model)."""
        return self.spec.uses_draft_model

    @property
    def draft_deployment(self) -> bool:
        """Whether the draft is a deployment of its own (not placed in the router)."""
        return self.uses_draft and self.draft.placement == "deployment"

    def target(self, name: str) -> TargetSpec:
        return next(t for t in self.targets if t.name == name)

    @property
    def deployed_targets(self) -> list[TargetSpec]:
        """Targets that are Serve deployments of their own (the others are loaded by each router replica)."""
        return [t for t in self.targets if t.placement == "deployment"]

    @property
    def placed_targets(self) -> list[str]:
        """Names of the targets each router replica loads itself (`placement: router`)."""
        return [t.name for t in self.targets if t.placement == "router"]

    def engine_config(self, name: str) -> EngineConfig:
        """The core EngineConfig of one target (the same object the CLI and benchmarks build from)."""
        t = self.target(name)
        return EngineConfig(
            target=TargetConfig(name=t.name, source=t.source, dtype=resolve_dtype(t.dtype, t.device),
                                max_context=t.max_context, calibration=t.calibration),
            draft=DraftConfig(source=self.draft.source, exit_layers=self.draft.exit_layers,
                              thresholds=self.draft.thresholds, stop_confidence=self.draft.stop_confidence),
            spec=self.spec, cache_dir=self.cache_dir, trust_remote_code=self.trust_remote_code,
            num_threads=self.num_threads, wide_threads=self.wide_threads, linear_kernel=self.linear_kernel,
            kernel_times=self.kernel_times, prefix_cache=self.prefix_cache, adaptive_threads=self.adaptive_threads,
            suffix=self.suffix, deterministic=self.deterministic, prompt_round_tokens=self.prompt_round_tokens,
        )

    @model_validator(mode="after")
    def _autoscaling_reachable(self) -> "AppConfig":
        """Serve adds replicas when a deployment's ongoing calls per replica exceed target_ongoing_requests, but a
        router keeps at most one call in flight per replica of each deployment (one round per target at a time):
        a target replica sees at most one call per router replica, the draft one per router and target. A threshold
        at or above that never scales up."""
        routers = router_ceiling(self.router)
        for where, opts, calls in [(f"targets[{t.name}]", t, routers) for t in self.deployed_targets] + (
                [("draft", self.draft, routers * len(self.targets))] if self.draft_deployment else []):
            auto = opts.autoscaling_config
            if not auto or auto.get("policy") or (auto.get("max_replicas") or 1) <= (auto.get("min_replicas") or 1):
                continue
            threshold = auto.get("target_ongoing_requests", SERVE_TARGET_ONGOING)
            if threshold >= calls:
                raise ValueError(
                    f"{where}.autoscaling_config.target_ongoing_requests: {threshold} is never exceeded: each of at "
                    f"most {routers} router replicas keeps one call in flight per replica, so a replica sees at most "
                    f"{calls}; set it below {calls} (deployments/autoscale.yaml: 1 for targets, the draft on "
                    "DraftBusyPolicy)")
        return self

    @model_validator(mode="after")
    def _memory_fits(self) -> "AppConfig":
        self.check_memory()  # raises when not even one full-length row fits
        return self
