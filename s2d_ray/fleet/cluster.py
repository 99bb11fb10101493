"""Does a Serve config fit a Ray cluster config (`s2d plan CONFIG --cluster cluster.yaml`)?

Two rules, the ones Ray's autoscaler needs to place every replica:
- every deployment's replica fits ONE node type: its actor's resources, or, for a tensor-parallel target, the sum of
  its placement group's bundles (STRICT_PACK puts the replica and all its ranks on one node);
- the node types' `max_workers` (and the cluster's) hold every deployment at its `max_replicas` at once: replicas
  are packed first-fit, largest first, onto the head, the `min_workers` nodes, then new nodes of a type they fit,
  as the autoscaler's bin-packing adds them.
A mismatch is a `ClusterFitError` naming the deployment and the node type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Resource names a node declares; anything else a replica asks for (memory, object_store_memory) is not a node
# type's to declare in cluster.yaml and is not checked.
STANDARD = ("CPU", "GPU")
EPS = 1e-9


class ClusterFitError(ValueError):
    """A deployment that no node type holds, or more replicas than max_workers allows."""


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]
    min_workers: int
    max_workers: int
    head: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """The parts of a `ray up` cluster config that decide placement."""

    name: str
    node_types: tuple[NodeType, ...]
    max_workers: int
    upscaling_speed: float
    idle_timeout_minutes: float

    @property
    def head(self) -> NodeType:
        return next(t for t in self.node_types if t.head)

    @property
    def workers(self) -> tuple[NodeType, ...]:
        return tuple(t for t in self.node_types if not t.head)


def read_cluster(path: Path) -> ClusterSpec:
    """Node types of a `ray up` YAML (`available_node_types`, `head_node_type`, `max_workers`)."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    types = doc.get("available_node_types")
    head = doc.get("head_node_type")
    if not isinstance(types, dict) or not types:
        raise ClusterFitError(f"{path}: no available_node_types")
    if head not in types:
        raise ClusterFitError(f"{path}: head_node_type {head!r} is not one of available_node_types {sorted(types)}")
    cluster_max = int(doc.get("max_workers", 2))
    nodes = []
    for name, spec in types.items():
        res = {k: float(v) for k, v in (spec.get("resources") or {}).items()}
        nodes.append(NodeType(name, res, int(spec.get("min_workers", 0)),
                              0 if name == head else int(spec.get("max_workers", cluster_max)), name == head))
    return ClusterSpec(str(doc.get("cluster_name", "default")), tuple(nodes), cluster_max,
                       float(doc.get("upscaling_speed", 1.0)), float(doc.get("idle_timeout_minutes", 5)))


@dataclass(frozen=True)
class Demand:
    """What one replica of a deployment reserves, and how many replicas there can be."""

    deployment: str  # as the app config names it: router, draft, targets[NAME]
    bundles: tuple[dict[str, float], ...]  # one: a plain actor; several: a STRICT_PACK placement group
    max_replicas: int

    @property
    def need(self) -> dict[str, float]:
        """The replica's whole reservation on its node (the bundles summed)."""
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return {k: v for k, v in out.items() if v > 0}


def _actor_bundle(opts: dict[str, Any]) -> dict[str, float]:
    res = {"CPU": float(opts.get("num_cpus") or 0), "GPU": float(opts.get("num_gpus") or 0)}
    res.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    return {k: v for k, v in res.items() if v > 0}


def _max_replicas(opts) -> int:
    if opts.autoscaling_config is not None:
        return int(opts.autoscaling_config.get("max_replicas") or 1)
    return int(opts.num_replicas or 1)


def demands(app) -> list[Demand]:
    """Every deployment the app config (an `AppConfig`) creates: router, draft (when a deployment), targets."""
    out = [Demand("router", (_actor_bundle(app.router.actor_options()),), _max_replicas(app.router))]
    if app.draft_deployment:
        out.append(Demand("draft", (_actor_bundle(app.draft.actor_options()),), _max_replicas(app.draft)))
    for t in app.deployed_targets:
        pg = t.placement_group()
        bundles = tuple(pg["placement_group_bundles"]) if pg else (_actor_bundle(t.actor_options()),)
        out.append(Demand(f"targets[{t.name}]", tuple({k: float(v) for k, v in b.items()} for b in bundles),
                          _max_replicas(t)))
    return out


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(v <= have.get(k, 0.0) + EPS for k, v in need.items() if not _ignored(k))


def _ignored(key: str) -> bool:
    return key in ("memory", "object_store_memory")


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items()) if not _ignored(k)) + "}"


def _describe(d: Demand) -> str:
    if len(d.bundles) == 1:
        return f"one replica needs {_fmt(d.need)}"
    return (f"one replica is a placement group of {len(d.bundles)} bundles (STRICT_PACK: one node) needing "
            f"{_fmt(d.need)}")


def node_types_for(d: Demand, cluster: ClusterSpec) -> list[NodeType]:
    """The node types one replica of `d` fits on; none is a ClusterFitError naming the closest types."""
    fit = [t for t in cluster.node_types if _fits(d.need, t.resources)]
    if fit:
        return fit
    custom = sorted(k for k in d.need if k not in STANDARD and not _ignored(k))
    declaring = [t for t in cluster.node_types if all(t.resources.get(k, 0) > 0 for k in custom)]
    if not declaring:
        missing = [k for k in custom if not any(t.resources.get(k, 0) > 0 for t in cluster.node_types)]
        raise ClusterFitError(f"{d.deployment}: {_describe(d)}; no node type declares {', '.join(missing)}")
    short = "; ".join(f"node type {t.name} has {_fmt(t.resources)}" for t in declaring)
    raise ClusterFitError(f"{d.deployment}: {_describe(d)}; {short}")


@dataclass
class _Node:
    type: NodeType
    free: dict[str, float]
    held: dict[str, int] = field(default_factory=dict)

    def take(self, d: Demand) -> bool:
        if not _fits(d.need, self.free):
            return False
        for k, v in d.need.items():
            if k in self.free:
                self.free[k] -= v
        self.held[d.deployment] = self.held.get(d.deployment, 0) + 1
        return True


def _pack(items: list[tuple[Demand, list[NodeType]]], cluster: ClusterSpec,
          limits: dict[str, int | float]) -> tuple[list[_Node], tuple[Demand, NodeType | None] | None]:
    """First-fit decreasing: every replica at max_replicas onto the head, the min_workers nodes, then new nodes of
    the first type it fits that `limits` still allows. Returns the nodes and the first replica that found no room."""
    nodes = [_Node(cluster.head, dict(cluster.head.resources))]
    for t in cluster.workers:
        nodes += [_Node(t, dict(t.resources)) for _ in range(t.min_workers)]
    units = [(d, types) for d, types in items for _ in range(d.max_replicas)]
    # Fewest possible node types first (they have no choice), then the largest.
    units.sort(key=lambda u: (len(u[1]), -u[0].need.get("GPU", 0), -sum(u[0].need.values())))
    first_miss = None
    for d, types in units:
        if any(n.type in types and n.take(d) for n in nodes):
            continue
        workers = sum(1 for n in nodes if not n.type.head)
        launchable = [t for t in types if not t.head and workers < limits["*"]
                      and sum(1 for n in nodes if n.type is t) < limits[t.name]]
        if launchable:
            node = _Node(launchable[0], dict(launchable[0].resources))
            node.take(d)
            nodes.append(node)
        elif first_miss is None:
            first_miss = (d, next((t for t in types if not t.head), None))
    return nodes, first_miss


@dataclass(frozen=True)
class FitReport:
    """Where each deployment can go and how many nodes of each type its max_replicas take."""

    placements: dict[str, list[str]]  # deployment -> node types one replica fits
    nodes_at_max: dict[str, int]  # node type -> nodes in use with every deployment at max_replicas
    held: dict[str, dict[str, int]]  # node type -> deployment -> replicas packed there

    def as_dict(self) -> dict:
        return {"placements": self.placements, "nodes_at_max": self.nodes_at_max, "held": self.held}


def check_fit(app, cluster: ClusterSpec) -> FitReport:
    """Both rules; raises ClusterFitError naming the deployment and the node type."""
    items = [(d, node_types_for(d, cluster)) for d in demands(app)]
    limits: dict[str, int | float] = {"*": cluster.max_workers, **{t.name: t.max_workers for t in cluster.workers}}
    nodes, miss = _pack(items, cluster, limits)
    if miss is not None:
        d, node_type = miss
        unbounded: dict[str, int | float] = {k: math.inf for k in limits}
        need, _ = _pack(items, cluster, unbounded)
        if node_type is None:
            raise ClusterFitError(f"{d.deployment}: max_replicas {d.max_replicas} do not fit the head node "
                                  f"({cluster.head.name}) and no worker node type holds one replica")
        count = sum(1 for n in need if n.type is node_type)
        workers = sum(1 for n in need if not n.type.head)
        on_type = sorted({k for n in need if n.type is node_type for k in n.held})
        if count > node_type.max_workers:
            raise ClusterFitError(
                f"{d.deployment}: max_replicas of {', '.join(on_type)} need {count} {node_type.name} nodes; node type "
                f"{node_type.name} has max_workers {node_type.max_workers}")
        raise ClusterFitError(f"{d.deployment}: max_replicas of every deployment need {workers} worker nodes "
                              f"(node type {node_type.name} among them); the cluster's max_workers is "
                              f"{cluster.max_workers}")
    held: dict[str, dict[str, int]] = {}
    for n in nodes:
        for dep, k in n.held.items():
            held.setdefault(n.type.name, {})
            held[n.type.name][dep] = held[n.type.name].get(dep, 0) + k
    counts = {t.name: sum(1 for n in nodes if n.type is t) for t in cluster.node_types}
    return FitReport({d.deployment: [t.name for t in types] for d, types in items}, counts, held)


def fit_markdown(report: FitReport, cluster: ClusterSpec) -> str:
    lines = ["| deployment | fits node types |", "|---|---|"]
    lines += [f"| {d} | {', '.join(types)} |" for d, types in report.placements.items()]
    lines += ["", "| node type | nodes at max_replicas | max_workers | replicas there |", "|---|---|---|---|"]
    for t in cluster.node_types:
        held = ", ".join(f"{d} x{k}" for d, k in sorted(report.held.get(t.name, {}).items())) or "-"
        lines.append(f"| {t.name} | {report.nodes_at_max[t.name]} | {'head' if t.head else t.max_workers} | {held} |")
    return "\n".join(lines) + "\n"
