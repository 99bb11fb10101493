"""One aggregation point for /metrics: every router replica's counters summed in one place, so a scrape that Serve's
load balancer sends to any router sees the whole app, and a counter never goes down from one scrape to the next.

Each router replica keeps its own prometheus_client registry and pushes a snapshot of it here about once a second
(and just before it answers a scrape). The hub keeps the last snapshot of every router replica it has heard from,
gone ones included: a counter's sum over replicas then only grows (a replica's own counters only grow, and a
replica that leaves keeps its last values). Gauges (requests running, waiting) sum over the replicas heard from in
the last GAUGE_STALE_S only. Figures that live in the deployments (the draft's capacity gauges, the targets'
prefix-cache counters) are folded in here once per scrape from the stats the scraping router gathered, each target
replica's count by its increase (ServeMetrics.record_prefix_cache), so two routers never count one hit twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from ray import serve

from .metrics import ServeMetrics

logger = logging.getLogger(__name__)

GAUGE_STALE_S = 30.0
PUSH_S = 1.0  # how often a router replica sends its counters to the hub

# (family name, type, documentation, [(sample name, labels, value)]): picklable, what a router pushes
Family = tuple[str, str, str, list[tuple[str, dict, float]]]


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """A registry's families as plain tuples (created-time samples left out: they are not summable)."""
    return [(m.name, m.type, m.documentation,
             [(s.name, dict(s.labels), float(s.value)) for s in m.samples if not s.name.endswith("_created")])
            for m in registry.collect()]


def merge(snapshots: list[tuple[list[Family], bool]]) -> list[Metric]:
    """Families summed sample by sample over snapshots; a stale snapshot's gauges are left out."""
    merged: dict[str, tuple[str, str, dict[tuple, float]]] = {}
    for families, fresh in snapshots:
        for name, kind, doc, samples in families:
            if kind == "gauge" and not fresh:
                continue
            _, _, values = merged.setdefault(name, (kind, doc, {}))
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                values[key] = values.get(key, 0.0) + value
    out = []
    for name, (kind, doc, values) in merged.items():
        metric = Metric(name, doc, kind)
        for (sample, labels), value in values.items():
            metric.add_sample(sample, dict(labels), value)
        out.append(metric)
    return out


class _Merged:
    """A prometheus_client collector over a fixed list of merged families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


class HubPusher:
    """A router replica's side: its registry's snapshot to the hub every PUSH_S, from its first request on."""

    def __init__(self, hub, replica: str, registry: CollectorRegistry) -> None:
        self.hub, self.replica, self.registry = hub, replica, registry
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the pushes (once; in a fresh context: the loop must outlive the request that starts it)."""
        if self.hub is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())

    async def push(self) -> None:
        await self.hub.push.remote(self.replica, snapshot(self.registry))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(PUSH_S)
            try:
                await self.push()
            except Exception:  # the hub is being replaced: the next push carries the same (cumulative) counts
                logger.warning("metrics push failed", exc_info=True)


class MetricsHub:
    """The app's metrics, merged (one replica: it is the aggregation point)."""

    def __init__(self) -> None:
        self.routers: dict[str, tuple[float, list[Family]]] = {}  # replica -> (time of its last push, snapshot)
        self.deployments = ServeMetrics()  # the draft's gauges and the targets' prefix-cache counters

    def push(self, replica: str, families: list[Family]) -> None:
        self.routers[replica] = (time.monotonic(), families)

    def per_router(self, sample: str, labels: dict[str, str]) -> dict[str, float]:
        """One sample's last pushed value per router replica (how the load spread over them)."""
        want = sorted(labels.items())
        return {replica: sum(v for _, _, _, samples in fams for name, lab, v in samples
                             if name == sample and sorted(lab.items()) == want)
                for replica, (_, fams) in self.routers.items()}

    def render(self, draft_stats: dict | None, prefix_stats: dict[str, list[dict]]) -> bytes:
        """Prometheus text of the whole app, after folding in the deployments' figures a router just read."""
        self.deployments.record_draft(draft_stats)
        for model, replicas in prefix_stats.items():
            for stats in replicas:
                self.deployments.record_prefix_cache(model, stats)
        now = time.monotonic()
        parts = [(fams, now - at <= GAUGE_STALE_S) for at, fams in self.routers.values()]
        parts.append((snapshot(self.deployments.registry), True))
        registry = CollectorRegistry()
        registry.register(_Merged(merge(parts)))
        return generate_latest(registry)


MetricsHubDeployment = serve.deployment(name="metrics", num_replicas=1)(MetricsHub)
