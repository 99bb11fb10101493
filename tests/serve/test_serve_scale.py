"""Scaling out, with the soak's jobs and checks (tiny float64 models): 2 routers, 2 draft and 2 target replicas.

- Affinity: a router's rounds stay on one replica per deployment, so targets never recompute a prefix; the draft,
  given fewer rows than live sequences, reclaims least recently used rows and recomputes (counted), and every
  output stays exact. Each replica's cache stays within the bound docs/SERVING.md states.
- Faults under load at concurrency 16: a draft replica killed mid-run costs nothing (target-only rounds, then the
  other replica); a target replica killed mid-run ends only requests whose retried round fails too, with a clean 503.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from reliability_helpers import delete_app, deploy_app
from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, wait_until
from test_serve_soak import SPEC, check, plan, refs, run_job, run_phase  # noqa: F401  (refs is a fixture)

pytestmark = pytest.mark.serve

APP = "scale"
DRAFT_ROWS = 6  # fewer than a router's 8 live sequences: the draft must reclaim rows, and stay exact


@pytest.fixture(scope="module")
def scale_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    two = {"num_replicas": 2, "num_cpus": 0.1, "health_check_period_s": 1.0, "health_check_timeout_s": 10.0}
    target = {"dtype": "float64", "max_live_sequences": 32, **two}
    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), **target},
                    {"name": "tiny-b", "source": str(tiny_family["b"]), "max_context": 128, **target}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "max_live_sequences": DRAFT_ROWS,
                  "retry_after_s": 0.5, **two},
        "spec": SPEC,
        "limits": {"max_tokens_limit": 64, "max_body_bytes": 8192, "max_concurrent_sequences": 8,
                   "max_queued_requests": 64, "request_timeout_s": 120.0},
        "api_key": API_KEY,
        # The home rule alone: a new sequence's replica by its router's rank, not by its prompt's prefix (prefix
        # routing spreads one router's sequences on purpose: tests/serve/test_serve_prefix_routing.py).
        "router": {"num_replicas": 2, "num_cpus": 0.1, "prefix_routing": {"enabled": False}},
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), APP, serve_instance, cfg)
    yield app
    delete_app(APP)


def router_stats(app) -> dict[str, dict]:
    """/stats detail of every router replica (HTTP lands on either; poll until both answered)."""
    seen: dict[str, dict] = {}

    def both() -> bool:
        body = httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
        seen[body["router"]] = body
        return len(seen) == 2

    wait_until(both, timeout_s=30, interval_s=0.05)
    return seen


def recomputed(stats: dict[str, dict], deployment: str) -> int:
    return sum(n for s in stats.values() for n in s["recomputed_tokens"].get(deployment, {}).values())


def kv_bytes_per_token(config: dict, layers: int, dtype_bytes: int = 8) -> int:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * config["num_key_value_heads"] * head_dim * dtype_bytes


def test_affinity_keeps_targets_warm_and_memory_bounded(scale_app, refs, tiny_family):
    jobs = plan(random.Random(7), refs, 64)
    outs, _ = run_phase(scale_app.url, jobs)
    assert [(o.job.kind, why) for o in outs if (why := check(o))] == []
    stats = router_stats(scale_app)
    generated = sum(o.completion_tokens or 0 for o in outs)
    # Every target round landed where the sequence's KV was; the draft (6 rows for up to 8 sequences per router)
    # reclaimed rows and recomputed them, which only cost time: the outputs above are exact.
    assert recomputed(stats, "target-tiny-a") == 0 and recomputed(stats, "target-tiny-b") == 0, stats
    assert recomputed(stats, "draft") > 0
    # Two routers, two replicas of each deployment: each router keeps to its own replica (its rank's home), so no
    # replica serves both routers' rounds while the other idles (with one hashed key per router, all three
    # deployments landed apart only one time in eight).
    for dep in ("draft", "target-tiny-a", "target-tiny-b"):
        used = [set(s["recomputed_tokens"].get(dep, {})) for s in stats.values()]
        assert all(len(u) == 1 for u in used) and used[0] != used[1], (dep, used)
    print("SCALE", json.dumps({"generated": generated, "recomputed": {
        d: recomputed(stats, d) for d in ("draft", "target-tiny-a", "target-tiny-b")}}))

    config = json.loads((tiny_family["a"] / "config.json").read_text())
    spec = json.loads((tiny_family["draft"] / "s2d_draft.json").read_text())
    hidden = (len(spec["exit_layers"]) - 1) * config["hidden_size"] * 8
    slots = config["max_position_embeddings"] + 2 * len(spec["exit_layers"]) + 8
    draft = next(iter(stats.values()))["draft"]
    assert draft["num_evicted"] > 0
    assert draft["cache_bytes"] <= DRAFT_ROWS * slots * (kv_bytes_per_token(config, spec["num_layers"]) + hidden)


def _kill_one(deployment: str) -> str:
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#"))
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def _under_load(app, refs, seed: int, kill: str) -> list:
    """64 greedy jobs at the soak's concurrency; one replica of `kill` dies once requests are running."""
    jobs = [j for j in plan(random.Random(seed), refs, 120) if j.kind == "greedy"][:64]
    killer = threading.Timer(1.5, _kill_one, [kill])
    killer.start()
    outs, _ = run_phase(app.url, jobs)
    killer.join()
    return outs


def _wait_healthy(app, deployment: str) -> None:
    from ray import serve

    def replaced() -> bool:
        status = serve.status().applications[APP].deployments[deployment]
        return status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2

    wait_until(replaced, timeout_s=120, interval_s=1.0)


def test_draft_replica_killed_under_load_loses_nothing(scale_app, refs):
    outs = _under_load(scale_app, refs, seed=8, kill="draft")
    assert [(o.status, why) for o in outs if (why := check(o))] == []  # every output exact, no error at all
    _wait_healthy(scale_app, "draft")


def test_target_replica_killed_under_load_loses_nothing_and_recovers(scale_app, refs):
    started = time.monotonic()
    outs = _under_load(scale_app, refs, seed=9, kill="target-tiny-a")
    bad = [(o.status, o.error, why) for o in outs if (why := check(o))]
    # Calls that were on the dead replica are resent to the other (targets[].failover_s), which rebuilds their
    # sequences from their tokens: every request completes with exactly its expected tokens.
    assert bad == [], bad
    _wait_healthy(scale_app, "target-tiny-a")
    print("TARGET_KILL", json.dumps({"requests": len(outs), "failed": len(bad),
                                     "recovered_s": round(time.monotonic() - started, 1)}))
    again = run_phase(scale_app.url, [j for j in plan(random.Random(10), refs, 40) if j.kind == "greedy"])[0]
    assert [why for o in again if (why := check(o))] == []


AUTOSCALE_APP = "autoscale"
# Short windows so a test sees both directions within a minute; deployments/autoscale.yaml uses the same shape.
FAST = {"metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 1.0, "downscale_delay_s": 6.0}


def deployment_statuses(app: str) -> dict:
    from ray import serve

    return serve.status().applications[app].deployments


def replica_counts(app: str, states: tuple[str, ...] = ("RUNNING",), deployments: dict | None = None) -> dict[str, int]:
    """Replicas per deployment in these states (of `deployments`, one serve.status() already read, if given)."""
    deployments = deployment_statuses(app) if deployments is None else deployments
    return {name: sum(d.replica_states.get(s, 0) for s in states) for name, d in deployments.items()}


def ongoing_by_controller(app: str, names) -> dict:
    """The ongoing-request figure Serve's controller scales each deployment on (why a deployment stays up)."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    out = {}
    for name in names:
        try:
            out[name] = ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(
                DeploymentID(name=name, app_name=app)), timeout=10)
        except Exception as exc:  # diagnostics only
            out[name] = repr(exc)[:120]
    return out


BUSY_TARGET = 0.1


def test_autoscaling_up_under_load_and_down_after_with_exact_outputs(serve_instance, tiny_family, refs):
    """Router and targets autoscale (min 1, max 2) on ongoing requests, the draft on its busy fraction: up during a
    run at concurrency 16, down once it ends; requests running while replicas come and go lose nothing and stay
    exact."""
    from s2d_ray.serve import build_app

    def auto(target_ongoing: float, busy_target: float | None = None) -> dict:
        policy = {} if busy_target is None else {"policy": {
            "policy_function": "s2d_ray.serve.draft_autoscale:DraftBusyPolicy",
            "policy_kwargs": {"target_busy_fraction": busy_target}}}
        return {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                       "target_ongoing_requests": target_ongoing, **FAST, **policy},
                "num_cpus": 0.1, "health_check_period_s": 1.0}

    cfg = {
        # A router keeps at most one round call in flight per target, and not all the time (its rounds also wait for
        # the draft): 0.5 per replica scales a target up once two routers keep it busy more than half the time.
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", **auto(0.5)},
                    {"name": "tiny-b", "source": str(tiny_family["b"]), "dtype": "float64", "max_context": 128,
                     **auto(0.5)}],
        # The draft scales on its own busy fraction (draft_autoscale.DraftBusyPolicy), with a target the tiny draft
        # exceeds under this load and stays under with one client that pauses between requests.
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", **auto(1.0, busy_target=BUSY_TARGET)},
        "spec": SPEC,
        "limits": {"max_tokens_limit": 64, "max_body_bytes": 8192, "max_concurrent_sequences": 8,
                   "max_queued_requests": 64, "request_timeout_s": 120.0},
        "api_key": API_KEY,
        "router": auto(4.0),
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), AUTOSCALE_APP, serve_instance, cfg)
    try:
        rng = random.Random(11)
        peak: dict[str, int] = {}
        asked: dict[str, int] = {}  # replicas the controller started (running or still starting)
        decided: dict[str, float] = {}  # seconds from the load's start until the controller started a second replica
        reached: dict[str, float] = {}  # ... until it ran
        messages: dict[str, set[str]] = {}
        busy = {"load": 0.0, "quiet": 0.0}  # the highest draft busy fraction the routers' /stats showed, per phase
        low: dict[str, int] = {}  # the fewest running replicas each deployment had once the load ended
        samples: list[float] = []
        ongoing: list[dict] = []  # the controller's ongoing-request figures once the load ended (why one stays up)
        tick = [0]
        scaled = ("router", "draft", "target-tiny-a")  # must reach two replicas under the load
        phase = ["load"]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                deployments = deployment_statuses(AUTOSCALE_APP)  # one read per sample
                for name, n in replica_counts(AUTOSCALE_APP, deployments=deployments).items():
                    peak[name] = max(peak.get(name, 0), n)
                    if phase[0] == "quiet":
                        low[name] = min(low.get(name, n), n)
                    if n >= 2 and name not in reached:
                        reached[name] = round(time.monotonic() - started, 1)
                starting = ("RUNNING", "STARTING", "PENDING_MIGRATION")
                for name, n in replica_counts(AUTOSCALE_APP, starting, deployments).items():
                    asked[name] = max(asked.get(name, 0), n)
                    if n >= 2 and name not in decided:
                        decided[name] = round(time.monotonic() - started, 1)
                for name, d in deployments.items():  # why it is upscaling, or why a replica has not started
                    if d.message:
                        messages.setdefault(name, set()).add(f"{d.status}: {d.message}"[:200])
                # A /stats call reaches every replica of every deployment, so the probe is itself load: every 0.5 s
                # under load, every 5 s once it ends (at 0.5 s a slow host's stats calls alone can hold a target's
                # ongoing-request average near its 0.5 target).
                tick[0] += 1
                if phase[0] == "load" or tick[0] % 10 == 0:
                    try:  # a router replica going away mid-call is expected here
                        draft = app.handle.stats.remote().result(timeout_s=5)["draft"]
                        busy[phase[0]] = max(busy[phase[0]], draft.get("busy_fraction", 0.0))
                        samples.append(round(draft.get("busy_fraction", 0.0), 3))
                    except Exception:
                        pass
                if phase[0] == "quiet" and tick[0] % 4 == 0:
                    seen = ongoing_by_controller(AUTOSCALE_APP, (*scaled, "target-tiny-b"))
                    ongoing.append({k: round(v, 2) if isinstance(v, float) else v for k, v in seen.items()})
                time.sleep(0.5)

        started = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        loaded: list = []
        # The controller starts every second replica soon after the load begins; running it is replica start-up on a
        # saturated small machine (imports and weights at a fraction of a core), which can take minutes. So the load
        # lasts 180 s at most unless every second replica has been started by then (the decision this test is
        # about), and then until they run, 420 s at most.
        def loading() -> bool:
            if all(peak.get(d, 0) >= 2 for d in scaled):
                return False
            bound = 420 if all(asked.get(d, 0) >= 2 for d in scaled) else 180
            return time.monotonic() - started < bound

        while loading():
            loaded += run_phase(app.url, [j for j in plan(rng, refs, 60) if j.kind == "greedy"])[0]
        up_s = time.monotonic() - started
        # Load drops to one client that pauses between requests: replicas drain and go while its requests run. The
        # pause scales with the request's own time so the draft stays well under its busy target on a fast machine
        # and a slow one alike (a fixed pause can leave a slow machine's draft busy enough to keep a second replica).
        # Each deployment must come down to one replica; with a look-back of 2 s a slow host's single quiet request
        # can bring one back up for a while, so every deployment may be down once without all being down at the same
        # moment: each is checked on its own. After 60 s of paced requests the client stops altogether: with no load
        # at all every deployment must reach one replica (on a slow host the paced client alone can keep a target's
        # ongoing-request average above its 0.5 target for minutes).
        phase[0] = "quiet"
        quiet = []

        def all_down() -> bool:
            return bool(low) and all(n == 1 for n in low.values())

        while time.monotonic() - started < up_s + 60 and not all_down():
            for job in [j for j in plan(rng, refs, 6) if j.kind == "greedy"]:
                sent = time.monotonic()
                quiet.append(run_job(app.url, job))
                time.sleep(max(1.0, 6 * (time.monotonic() - sent)))
        while time.monotonic() - started < up_s + 240 and not all_down():
            time.sleep(1.0)
        down_s = time.monotonic() - started - up_s
        stop.set()
        watcher.join()
        final = replica_counts(AUTOSCALE_APP)
        figures = {"ongoing_after_load": ongoing[-10:], "peak": peak, "started": asked,
                   "second_replica_started_s": decided, "second_replica_running_s": reached,
                   "quiet_low": low, "final": final,
                   "up_s": round(up_s, 1), "down_s": round(down_s, 1),
                   "requests_under_load": len(loaded), "requests_while_scaling_down": len(quiet),
                   "draft_busy_max": {k: round(v, 3) for k, v in busy.items()}, "last": samples[-30:],
                   "messages": {k: sorted(v) for k, v in messages.items()}}
        print("AUTOSCALE", json.dumps(figures))
        assert [why for o in loaded + quiet if (why := check(o))] == []
        assert all(peak[d] == 2 for d in scaled), json.dumps(figures)
        assert set(low) == set(peak) and all(n == 1 for n in low.values()), json.dumps(figures)
    finally:
        delete_app(AUTOSCALE_APP)
