"""`s2d plan CONFIG [--device h100] [--rate R] [--json]`: the fleet capacity model (docs/FLEET.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .hardware import DEVICES, device


def register(sub) -> None:
    p = sub.add_parser("plan", help="fleet capacity model: tokens/s per GPU and GPUs needed, with/without a draft")
    p.add_argument("config", type=Path, help="Serve YAML, e.g. deployments/gpu.yaml")
    p.add_argument("--device", default="h100", choices=sorted(DEVICES), help="hardware the targets run on")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second per target")
    p.add_argument("--tokens", type=int, default=None, help="output tokens per request (default: default_max_tokens)")
    p.add_argument("--agree", type=float, default=None,
                   help="draft/target per-token agreement (default: the committed SmolLM2 profile's, measured)")
    p.add_argument("--profile", type=Path, default=None, help="calibration profile to read the agreement from")
    p.add_argument("--context", type=int, default=512, help="tokens of KV per sequence")
    p.add_argument("--cross-node-ms", type=float, default=None,
                   help="extra ms of a deployment call from the router to another node (default: the value "
                        "`s2d bench cross-node` measured, fleet/model.py CROSS_NODE_MS)")
    p.add_argument("--json", action="store_true", help="print the whole model as JSON")
    p.add_argument("--plot", type=Path, default=None, help="also write a PNG (tok/s per GPU by batch, GPUs by rate)")
    p.add_argument("--cluster", type=Path, default=None,
                   help="a `ray up` cluster config (cluster.yaml): check first that every deployment fits one of its "
                        "node types and that max_workers holds every max_replicas (a mismatch exits 2)")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from .plan import plan

    if args.rate <= 0 or args.context < 1 or (args.tokens is not None and args.tokens < 1):
        raise ValueError("--rate, --context and --tokens must be positive")
    if args.cross_node_ms is not None and args.cross_node_ms < 0:
        raise ValueError("--cross-node-ms must be >= 0")
    if args.agree is not None and not 0 <= args.agree < 1:
        raise ValueError("--agree must be in [0, 1)")
    if not args.config.is_file():
        raise ValueError(f"{args.config} does not exist")
    fit = cluster_fit(args.config, args.cluster) if args.cluster else None
    from .model import CROSS_NODE_MS

    cross = CROSS_NODE_MS if args.cross_node_ms is None else args.cross_node_ms
    result = plan(args.config, device(args.device), args.rate, args.tokens, args.agree, args.profile, args.context,
                  cross_node_ms=cross)
    if args.plot:
        from .plot import plot_fleet

        # the plan's own agreement beside an assumed better draft's, so the plot draws what the table says
        plot_fleet(args.config, device(args.device), args.plot, agrees=(round(result["agree"], 2), 0.7))
    if args.json:
        if fit is not None:
            result["cluster_fit"] = {"cluster": str(args.cluster), **fit[0].as_dict()}
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    if fit is not None:
        sys.stdout.write(f"{args.config} fits {args.cluster}:\n\n" + fit[1] + "\n")
    sys.stdout.write(plan_markdown(result))
    return 0


def cluster_fit(config: Path, cluster_path: Path):
    """The fit check's report and its table; a mismatch raises ClusterFitError (a ValueError: one line, exit 2)."""
    from .cluster import check_fit, fit_markdown, read_cluster
    from .plan import read_app_config

    if not cluster_path.is_file():
        raise ValueError(f"{cluster_path} does not exist")
    cluster = read_cluster(cluster_path)
    report = check_fit(read_app_config(config), cluster)
    return report, fit_markdown(report, cluster)


def plan_markdown(r: dict) -> str:
    lines = [f"{r['config']} on {r['device']['name']}: {r['rate_per_target']} req/s per target x "
             f"{r['tokens_per_request']} tokens, agreement {r['agree']:.2f} ({r['agree_source']}), "
             f"{r['cross_node_ms']:g} ms per call across nodes", "",
             "| target | fleet | k | tok/s per replica | tok/s per GPU | replicas | GPUs | ms/token per stream |",
             "|---|---|---|---|---|---|---|---|"]
    for t in r["targets"]:
        for name, f in t["fleets"].items():
            lines.append(f"| {t['target']} | {name} | {f['k']} | {f['tokens_per_s_per_replica']} | "
                         f"{f['tokens_per_s_per_target_gpu']} | {f['replicas']} | {f['target_gpus']} | "
                         f"{f['latency_ms_per_token']} |")
    lines += ["", "| fleet | GPUs (draft GPUs) | draft models trained | draft weights GB |", "|---|---|---|---|"]
    for name, t in r["totals"].items():
        lines.append(f"| {name} | {t['gpus']} ({t['draft_gpus']}) | {t['draft_training_runs']} | {t['draft_weights_gb']} |")
    return "\n".join(lines) + "\n"
