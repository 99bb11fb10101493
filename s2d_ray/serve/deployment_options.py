"""The Ray Serve options of the app's deployments: replicas or autoscaling, resources, health checks, batching.

A subset of Serve's own options with defaults that fit a small machine; `serve_options()` turns one into the keyword
arguments of `Deployment.options`. The app's schema (serve/app_config.py) mixes them into each deployment's config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .affinity import PrefixRoutingConfig


class StrictModel(BaseModel):
    """A frozen pydantic model that rejects unknown fields (a misspelt option is an error, not ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentOptions(StrictModel):
    """The Ray Serve options of one deployment (a subset of Serve's, with defaults that fit a 2-core machine)."""

    num_replicas: int | None = Field(1, ge=1, description="Fixed replica count; leave unset when autoscaling.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...)."
    )
    num_cpus: float = Field(0.5, ge=0, description="Logical CPUs reserved for each replica actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for each replica actor.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per replica.")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="Further ray_actor_options (runtime_env, memory, ...) merged over ours."
    )
    max_ongoing_requests: int = Field(256, ge=1, description="Concurrent calls one replica accepts.")
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between check_health calls.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A check_health slower than this fails.")
    graceful_shutdown_timeout_s: float | None = Field(
        None, gt=0, description="How long a replica being removed (scale-down, redeploy) keeps serving its calls; "
        "unset: Serve's default (20 s), except the router, which waits up to limits.request_timeout_s so that "
        "streams in flight finish instead of being cut.")

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> "DeploymentOptions":
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("give either num_replicas or autoscaling_config, not both")
        return self

    @property
    def device(self) -> str:
        """Where the replica's model runs: "cuda" when it reserves GPUs, through num_gpus or
        ray_actor_options.num_gpus (what `dtype: auto` is resolved for)."""
        return "cuda" if (self.actor_options().get("num_gpus") or 0) > 0 else "cpu"

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        opts.update(self.ray_actor_options)
        return opts

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options`."""
        opts: dict[str, Any] = {
            "ray_actor_options": self.actor_options(),
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.graceful_shutdown_timeout_s is not None:
            opts["graceful_shutdown_timeout_s"] = self.graceful_shutdown_timeout_s
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class BatchOptions(StrictModel):
    """How concurrent calls merge into one forward (`@serve.batch`)."""

    max_batch_size: int = Field(16, ge=1, description="Most calls merged into one forward.")
    batch_wait_timeout_s: float = Field(
        0.0, ge=0, description="How long the first call of a batch waits for others. A router sends ONE call per "
        "round with all its sequences, so only other routers' calls could merge, and calls that queue while a forward "
        "runs merge anyway: at low concurrency a wait only adds its length to every round."
    )
    max_live_sequences: int = Field(
        32, ge=1, description="Sequences whose KV one replica keeps (cache rows); in an app, unset means 32 or, "
        "where more, as many as a router decodes together (a target's max_concurrent_sequences; for the draft, their "
        "sum over the targets); rows beyond the live sequences keep finished ones' prefixes (prefix_cache). "
        "Past it the least recently used sequence's row is reclaimed (it recomputes if it returns) and larger forwards "
        "are split, so a router decodes at most this many of a target's sequences together (the rest queue); with "
        "the context this bounds replica memory (docs/SERVING.md, 'Memory per replica')."
    )


class RouterOptions(DeploymentOptions):
    """The ingress deployment (OpenAI API, the decode loops); it holds tokenizers only, no weights."""

    max_ongoing_requests: int = Field(1024, ge=1, description="Concurrent HTTP/handle requests one router accepts.")
    stream_interval: int = Field(
        1, ge=1, le=1024, description="Tokens a streamed chunk holds at least (vLLM's and SGLang's --stream-interval): "
        "1 sends every round's tokens at once; more sends fewer chunks (less work for the router, the proxy and the "
        "client, on the cores that decode) at a coarser inter-token latency. The first tokens and the last chunk "
        "are never held.")
    whole_rounds: bool = Field(
        True, description="A target placed in the router (with the draft placed there too, or no draft) runs each "
        "round whole on the process's model thread while no other target of the router has work: one thread hop per "
        "round instead of one per call, no batch queue. False: every round goes through the draft's and the "
        "target's batch queues (what lets rounds of several targets merge into one draft forward).")
    keepalive_s: float = Field(
        5.0, gt=0, description="A stream still waiting for its first tokens after 1 s (queued for a decode slot, a "
        "long prefill) starts with status 200 and sends an SSE comment line (`: keep-alive`) this often until they "
        "come, so proxies and clients with idle timeouts keep the connection; errors after that are in-band.")
    prefix_routing: PrefixRoutingConfig = Field(
        default_factory=PrefixRoutingConfig, description="Which target and draft replica a new sequence goes to: "
        "where its prompt's first block was cached, within a load bound (docs/SERVING.md; off with prefix_cache).")


SERVE_TARGET_ONGOING = 2  # Serve's default target_ongoing_requests


def router_ceiling(router: "RouterOptions") -> int:
    """The most router replicas there can be: autoscaling's max_replicas, else num_replicas."""
    if router.autoscaling_config is not None:
        return int(router.autoscaling_config.get("max_replicas") or 1)
    return router.num_replicas or 1


# Serve's in-loop mode (part of RAY_SERVE_THROUGHPUT_OPTIMIZED), read by each replica process when it starts.
IN_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
