"""`s2d plan CONFIG`: per target and fleet, tokens/s per replica and per GPU and the GPUs a request rate needs.

Three fleets serve the same targets at the same rate:
- `none`: plain decoding (k = 0);
- `per_target`: each target replica runs its own draft on its own GPU(s), drafting and verifying in turn (one
  draft model trained per target, a copy in every replica's memory);
- `shared`: one sorted draft deployment drafts for every target (one training run, one copy per draft replica);
  target GPUs only verify (two batches in flight per replica interleave draft and verify), and the draft GPU's work
  is merged across targets into batches of the draft's `max_batch_size` rows.
Each fleet picks, per target, the draft length k that minimises GPU-seconds per token (k = 0 allowed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from .hardware import Device, device
from .model import CROSS_NODE_MS, DTYPE_BYTES, Replica, forward_ms, mat
from .shapes import ModelShape, known_shape, shape_of

BATCHES = (1, 2, 4, 8, 16, 32)
POSITIONS = (1, 2, 4, 8, 16)
DEFAULT_PROFILE = (Path(__file__).parents[1] / "assets" / "drafts" / "smollm2-135m-s2d" / "calibration"
                   / "smollm2-135m-instruct.bfloat16.json")


def read_app_config(path: Path):
    """The Serve YAML's one s2d application's args, validated as the app would validate them."""
    from ..serve.app_config import AppConfig

    doc = yaml.safe_load(path.read_text())
    apps = [a for a in (doc or {}).get("applications", []) if "s2d_ray.serve" in str(a.get("import_path", ""))]
    if not apps:
        raise ValueError(f"{path} has no application with import_path s2d_ray.serve:build_app")
    return AppConfig.model_validate(apps[0].get("args") or {})


def model_shape(source: str) -> ModelShape:
    """From the table by name, else from a local Hugging Face config."""
    shape = known_shape(source)
    if shape is not None:
        return shape
    if (Path(source) / "config.json").is_file():
        from transformers import AutoConfig

        return shape_of(AutoConfig.from_pretrained(source))
    raise ValueError(f"no shape known for {source!r}: use a name from s2d_ray/fleet/shapes.py or a local model dir")


def draft_shape_of(source: str, exit_layers: list[int] | None = None) -> tuple[ModelShape, int]:
    """A draft's shape (its layers, base widths, reduced head) and the depth of its deepest exit: from its
    s2d_draft.json (a directory or a committed draft name), else from its base's name and `exit_layers`."""
    if source.startswith("cut:"):
        from ..build import parse_cut

        model, layers, exits = parse_cut(source)
        depth = max(exits or exit_layers or [layers])
        return model_shape(model).with_layers(layers), depth
    committed = Path(__file__).parents[1] / "assets" / "drafts" / source / "s2d_draft.json"
    for p in (Path(source) / "s2d_draft.json", committed):
        if p.is_file():
            spec = json.loads(p.read_text())
            base = model_shape(spec["base_model"])
            return base.with_layers(spec["num_layers"], spec.get("reduced_vocab")), max(spec["exit_layers"])
    if not exit_layers:
        raise ValueError(f"draft {source}: set draft.exit_layers in the config (its depth)")
    return model_shape(source).with_layers(max(exit_layers)), max(exit_layers)


def dtype_bytes(dtype: str, dev: Device) -> int:
    """Bytes per weight of a config's dtype on this device (`auto` resolves as the replica would resolve it)."""
    from ..hardware import resolve_dtype

    return DTYPE_BYTES[resolve_dtype(dtype, "cpu" if dev.overlap is False else "cuda")]


def acceptance(profile_path: Path | None, agree: float | None) -> tuple[float, str]:
    """Per-token agreement of the draft with a target: given, or a calibration profile's measured one."""
    if agree is not None:
        return agree, "given (--agree)"
    path = profile_path or DEFAULT_PROFILE
    profile = json.loads(path.read_text())
    return float(profile["on_path"]["s2d_agree"]), f"measured: {path.name} on_path.s2d_agree"


def shared_draft_row_ms(rep: Replica, k: int, shared_depth_ms: float, draft_batch: int) -> float:
    """Shared-draft GPU ms per token: k depths per round, each a row of a full draft batch, over MAT tokens."""
    return k * shared_depth_ms / draft_batch / mat(rep.agree, k)


def gpu_seconds_per_token(rep: Replica, batch: int, k: int, shared_depth_ms: float | None, draft_batch: int) -> float:
    """GPU time one token costs: target GPUs (tp of them) for its round share, plus the shared draft's share."""
    shared = shared_depth_ms is not None
    target = rep.tp * rep.round_ms(batch, k, draft_elsewhere=shared) / (batch * mat(rep.agree, k))
    draft = shared_draft_row_ms(rep, k, shared_depth_ms, draft_batch) if shared else 0.0
    return 1e-3 * (target + draft)


def plan_target(t, rep_none: Replica, rep_draft: Replica, rate: float, tokens: int, draft_batch: int,
                shared_depth_ms: float, max_k: int) -> dict:
    batch = t.max_concurrent_sequences or t.max_batch_size
    need = rate * tokens  # tokens/s this target must produce
    out = {"target": t.name, "source": t.resolved_source, "tp": rep_none.tp, "batch": batch,
           "need_tokens_per_s": need, "costs_ms": {
               "step": {str(b): round(rep_none.step_ms(b), 3) for b in BATCHES},
               "verify": {str(b): {str(n): round(rep_none.verify_ms(b, n), 3) for n in POSITIONS} for b in BATCHES},
               "draft_depth": {str(b): round(rep_draft.draft_ms(b), 3) for b in BATCHES}}, "fleets": {}}
    for fleet, rep, depth_ms in (("none", rep_none, None), ("per_target", rep_draft, None),
                                 ("shared", rep_draft, shared_depth_ms)):
        ks = [0] if fleet == "none" else range(0, max_k + 1)
        k = min(ks, key=lambda k: (gpu_seconds_per_token(rep, batch, k, depth_ms, draft_batch), k))
        shared = depth_ms is not None
        tps = rep.tokens_per_s(batch, k, draft_elsewhere=shared)
        replicas = max(1, math.ceil(need / tps))
        draft_gpu_s = need * shared_draft_row_ms(rep, k, depth_ms, draft_batch) / 1e3 if shared else 0.0
        out["fleets"][fleet] = {"k": k, "mat": round(mat(rep.agree, k), 3), "tokens_per_s_per_replica": round(tps, 1),
                                "tokens_per_s_per_target_gpu": round(tps / rep.tp, 1), "replicas": replicas,
                                "target_gpus": replicas * rep.tp, "draft_gpu_busy": round(draft_gpu_s, 3),
                                "calls_per_round": rep.calls_per_round(k, shared),
                                "latency_ms_per_token": round(rep.latency_ms(batch, k, shared) / mat(rep.agree, k), 2)}
    return out


def plan(config: Path, dev: Device, rate: float, tokens: int | None = None, agree: float | None = None,
         profile: Path | None = None, context: int = 512, max_k: int = 12, cross_node_ms: float = CROSS_NODE_MS,
         ) -> dict:
    """The whole fleet at `rate` requests/s per target, `tokens` output tokens each; every deployment call crosses
    nodes (`cross_node_ms`): the router sits on a CPU node, the draft and the targets on GPU nodes."""
    app = read_app_config(config)
    tokens = tokens or app.limits.default_max_tokens
    dshape, depth = draft_shape_of(app.draft.source, app.draft.exit_layers)
    draft_batch = app.draft.max_batch_size
    a, a_source = acceptance(profile, agree)
    draft_bytes = dtype_bytes(app.draft.dtype, dev)
    shared_depth_ms = forward_ms(dshape, dev, draft_batch, 1, context, draft_bytes, depth) + dev.draft_depth_overhead_ms
    targets, per_target_draft_bytes = [], 0
    for t in app.targets:
        shape, tb = model_shape(t.resolved_source), dtype_bytes(t.dtype, dev)
        common = dict(target=shape, dev=dev, tp=t.tp_size, context=context, dtype_bytes=tb, agree=a,
                      cross_node_ms=cross_node_ms)
        rep_none = Replica(**common)
        rep_draft = Replica(**common, draft=dshape.shard(t.tp_size), draft_depth=depth)
        row = plan_target(t, rep_none, rep_draft, rate, tokens, draft_batch, shared_depth_ms, max_k)
        weights_gb = shape.shard(t.tp_size).weight_bytes(tb) / 1e9
        kv_gb = row["batch"] * context * shape.shard(t.tp_size).kv_bytes_per_token(tb) / 1e9
        row["memory_gb_per_gpu"] = {"weights": round(weights_gb, 2), "kv": round(kv_gb, 2),
                                    "fits": weights_gb + kv_gb < dev.memory_gb * 0.9}
        per_target_draft_bytes += row["fleets"]["per_target"]["replicas"] * dshape.weight_bytes(draft_bytes)
        targets.append(row)
    totals = {}
    for fleet in ("none", "per_target", "shared"):
        gpus = sum(r["fleets"][fleet]["target_gpus"] for r in targets)
        draft_gpus = math.ceil(sum(r["fleets"][fleet]["draft_gpu_busy"] for r in targets)) if fleet == "shared" else 0
        totals[fleet] = {"gpus": gpus + draft_gpus, "target_gpus": gpus, "draft_gpus": draft_gpus}
    totals["none"].update(draft_models=0, draft_training_runs=0, draft_weights_gb=0.0)
    totals["per_target"].update(draft_models=len(targets), draft_training_runs=len(targets),
                                draft_weights_gb=round(per_target_draft_bytes / 1e9, 2))
    totals["shared"].update(draft_models=1, draft_training_runs=1,
                            draft_weights_gb=round(max(totals["shared"]["draft_gpus"], 1)
                                                   * dshape.weight_bytes(draft_bytes) / 1e9, 2))
    return {"config": str(config), "device": dev.__dict__, "rate_per_target": rate, "tokens_per_request": tokens,
            "context": context, "agree": a, "agree_source": a_source, "cross_node_ms": cross_node_ms,
            "draft": {"shape": dshape.__dict__, "depth": depth, "max_batch_size": draft_batch,
                      "depth_ms_at_max_batch": round(shared_depth_ms, 3)},
            "targets": targets, "totals": totals}
