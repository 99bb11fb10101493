"""Autoscale the shared draft on its own busy fraction (Ray Serve custom autoscaling policy).

Ongoing requests say little about the draft: each router keeps about one propose call in flight whatever the load,
and one call may carry one row or sixteen. What saturates is the draft's model thread, so every draft replica reports
its busy fraction (`DraftDeployment.record_autoscaling_stats`) and this policy asks for enough replicas that each
would run at most `target_busy_fraction` busy: desired = sum of the replicas' busy fractions / target. Serve's wrapper
applies min/max_replicas, upscale/downscale delays and scaling factors from the same `autoscaling_config`.

    draft:
      autoscaling_config:
        min_replicas: 1
        max_replicas: 3
        policy: {policy_function: "s2d_ray.serve.draft_autoscale:DraftBusyPolicy",
                 policy_kwargs: {target_busy_fraction: 0.7}}

Serve pickles this module by value into its controller: keep it free of project imports.
"""

from __future__ import annotations

from typing import Any

BUSY_METRIC = "busy_fraction"


class DraftBusyPolicy:
    def __init__(self, target_busy_fraction: float = 0.7) -> None:
        if not 0.0 < target_busy_fraction <= 1.0:
            raise ValueError(f"target_busy_fraction must be in (0, 1], got {target_busy_fraction}")
        self.target_busy_fraction = target_busy_fraction

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        """Replicas for the measured drafting work; the current target until some replica has reported."""
        busy = (ctx.aggregated_metrics or {}).get(BUSY_METRIC) or {}
        if not busy:
            return ctx.target_num_replicas, {}
        return sum(busy.values()) / self.target_busy_fraction, {"draft_busy": sum(busy.values())}
