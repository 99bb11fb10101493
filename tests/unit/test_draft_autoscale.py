"""The draft's busy-fraction autoscaling policy, called the way Serve's controller calls it: resolved from the
`autoscaling_config.policy` import path (pickled by value), wrapped with the config's delays and scaling factors."""

from __future__ import annotations

import pytest

POLICY = {"policy_function": "s2d_ray.serve.draft_autoscale:DraftBusyPolicy",
          "policy_kwargs": {"target_busy_fraction": 0.5}}


def context(busy: list[float] | None, current: int, config):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    dep = DeploymentID("draft", "s2d")
    replicas = [ReplicaID(f"r{i}", dep) for i in range(current)]
    metrics = {} if busy is None else {"busy_fraction": dict(zip(replicas, busy))}
    return AutoscalingContext(
        deployment_id=dep, deployment_name="draft", app_name="s2d", current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=1.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=0.0, config=config)


def serve_policy(config):
    """What Serve's controller runs (ray/serve/_private/autoscaling_state.py)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    return _apply_autoscaling_config(_resolve_policy_callable(config.policy))


def test_replicas_follow_the_drafting_work_not_the_request_count():
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0,
                               policy=POLICY)
    policy = serve_policy(config)
    # One replica 90 % busy at a 0.5 target: 1.8 replicas of work -> 2 (same one request in flight throughout).
    assert policy(context([0.9], 1, config))[0] == 2
    # Two replicas at 0.6 and 0.7: 2.6 -> 3; both nearly idle: 0.2 -> down to 1.
    assert policy(context([0.6, 0.7], 2, config))[0] == 3
    assert policy(context([0.05, 0.05], 2, config))[0] == 1
    # No replica has reported yet (just started): keep the current count.
    assert policy(context(None, 2, config))[0] == 2


def test_policy_reads_its_target_from_the_config_and_refuses_nonsense():
    from s2d_ray.serve.draft_autoscale import DraftBusyPolicy

    assert DraftBusyPolicy().target_busy_fraction == 0.7
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="target_busy_fraction"):
            DraftBusyPolicy(bad)
