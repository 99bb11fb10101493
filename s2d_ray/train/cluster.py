"""The Ray cluster a multi-worker training command runs on: connecting, and refusing a worker count it cannot place.

Ray waits without end for resources that never come (a placement group of 8 GPU workers on a 4-GPU cluster just
pends), so the count is checked against the cluster's totals before any model is loaded.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConfigError

logger = logging.getLogger(__name__)


class WorkerSpec(BaseModel):
    """How many workers a command asks for and what each one holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1, description="workers (Ray actors or Ray Train workers)")
    cpus_per_worker: float = Field(1.0, gt=0, description="logical CPUs each worker reserves")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each worker reserves (0: CPU only)")
    address: str | None = Field(None, description="Ray address: None starts a local cluster, `auto` joins the "
                                                  "running one, `ray://host:10001` a remote one")


def connect(address: str | None) -> None:
    """Join (or start) the Ray cluster once per process; the dashboard stays off when Ray starts here."""
    import ray

    if ray.is_initialized():
        return
    kwargs = {"include_dashboard": False} if address is None else {}
    ray.init(address=address, log_to_driver=True, **kwargs)


def check_fits(spec: WorkerSpec, flag: str = "--num-workers") -> None:
    """Refuse, before any work, a worker count the cluster's CPUs or GPUs cannot hold (one line naming the flag)."""
    import ray

    total = ray.cluster_resources()
    for name, each in (("CPU", spec.cpus_per_worker), ("GPU", spec.gpus_per_worker)):
        need, have = spec.num_workers * each, total.get(name, 0.0)
        if need > have:
            raise ConfigError(f"{flag} {spec.num_workers} needs {need:g} {name}s ({each:g} per worker) but the Ray "
                              f"cluster has {have:g}; lower {flag} or add nodes")
    logger.info("%d workers fit the cluster (%s)", spec.num_workers, {k: total.get(k) for k in ("CPU", "GPU")})
