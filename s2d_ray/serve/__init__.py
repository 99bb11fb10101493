"""S2D on Ray Serve: one shared sorted-draft deployment, one deployment per target (optionally DeepSpeed TP), and an
OpenAI-compatible router that runs the rounds.

`build_app(args)` is the import path Serve YAMLs name (`import_path: s2d_ray.serve:build_app`); heavy imports
(ray, torch, transformers) happen inside it, so importing the package for its config stays cheap.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .app_config import AppConfig, DraftDeploymentConfig, Limits, TargetSpec
from .deployment_options import RouterOptions

if TYPE_CHECKING:
    from ray.serve import Application

logger = logging.getLogger(__name__)

__all__ = ["AppConfig", "DraftDeploymentConfig", "Limits", "RouterOptions", "TargetSpec", "build_app"]


def build_app(args: dict[str, Any] | AppConfig) -> "Application":
    """Validate the config and bind the application: draft (unless mode `ar`), one deployment per target, the
    metrics hub, router."""
    from .affinity_router import affinity_router_config
    from .draft_deployment import DraftDeployment
    from .lora_registry import AdapterRegistryDeployment
    from .metrics_hub import MetricsHubDeployment
    from .router import Router
    from .target_deployment import TargetDeployment

    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    # runtime LoRA loads shared by every router and target replica; placed like the metrics hub (below)
    hub_actor = {"num_cpus": 0, "resources": {k: min(v, 0.01) for k, v in cfg.router.resources.items()}}
    registry = None
    if any(t.lora is not None for t in cfg.targets):
        registry = AdapterRegistryDeployment.options(
            **cfg.deployment_options({"ray_actor_options": hub_actor})).bind()
    draft = None
    if cfg.draft_deployment:  # else the router loads the draft itself (draft.placement: router)
        draft = DraftDeployment.options(name="draft", request_router_config=affinity_router_config(),
                                        **cfg.deployment_options(cfg.draft.serve_options())).bind(cfg)
    targets = {
        t.name: TargetDeployment.options(name=f"target-{t.name}", request_router_config=affinity_router_config(),
                                         **cfg.deployment_options(t.serve_options()), **t.placement_group())
        .bind(cfg, t.name, registry)
        for t in cfg.deployed_targets  # the others are loaded by the router (placement: router)
    }
    logger.info("s2d app: targets=%s (in the router: %s) draft=%s (%s) mode=%s", [t.name for t in cfg.targets],
                cfg.placed_targets,
                cfg.draft.source if cfg.uses_draft else None, cfg.draft.placement, cfg.spec.mode)
    router = cfg.deployment_options(cfg.router.serve_options())
    # A removed router replica lets its streams finish (they end by the request timeout anyway): Serve's default
    # 20 s would cut long streams during a scale-down or redeploy.
    router.setdefault("graceful_shutdown_timeout_s", cfg.limits.request_timeout_s)
    # one aggregation point for /metrics across router replicas; no CPU reserved (a dict sum once a second per router),
    # on the routers' kind of node (their custom resources, a sliver of each)
    hub = MetricsHubDeployment.options(**cfg.deployment_options({"ray_actor_options": hub_actor})).bind()
    return Router.options(name="router", **router).bind(cfg, draft, targets, hub, registry)
