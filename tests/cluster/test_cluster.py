"""The app on a multi-node Ray cluster (conftest: a head and four worker nodes, each its own raylet): placement by
the config's resources, read back from Ray's state API; outputs exactly the target's greedy tokens with the router,
the draft and the target on three nodes; and a node lost under four concurrent streams loses none of them.

The tests run in order on one app: the draft's node is lost (its replica moves to the other `s2d_small_gpu` node),
then the target's (to the other `s2d_large_gpu` node).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cluster_helpers import deploy, replicas_by_node
from reliability_helpers import metric, serve_conftest
from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, Reference, post, wait_until

pytestmark = pytest.mark.serve

MODEL = "tiny-a"
STREAM_TOKENS = 400  # long enough that a node dies while every stream is still running
PROMPTS = ["The cluster", "Ray nodes", "a b c d", "speculative decoding on several machines"]


def app_config(family: dict) -> dict:
    """Router on the head, the shared draft on an `s2d_small_gpu` node, the target on an `s2d_large_gpu` node."""
    return {
        "targets": [{"name": MODEL, "source": str(family["a"]), "dtype": "float64", "num_cpus": 0.5,
                     "resources": {"s2d_large_gpu": 1}, "failover_s": 90.0, "health_check_period_s": 1.0}],
        "draft": {"source": str(family["draft"]), "dtype": "float64", "num_cpus": 0.5,
                  "resources": {"s2d_small_gpu": 1}, "retry_after_s": 0.5, "call_timeout_s": 2.0,
                  "health_check_period_s": 1.0},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 3},
        "router": {"num_cpus": 0.5, "resources": {"node:__internal_head__": 0.01}},
        "limits": {"max_tokens_limit": STREAM_TOKENS, "max_concurrent_sequences": 4, "request_timeout_s": 240.0},
        "api_key": API_KEY,
        "num_threads": 1,
    }


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return serve_conftest().save_tiny_family(tmp_path_factory.mktemp("cluster-models"))


@pytest.fixture(scope="module")
def app(local_cluster, family) -> str:
    from s2d_ray.serve import build_app

    return deploy(build_app(app_config(family)), "cluster", local_cluster.port)


@pytest.fixture(scope="module")
def reference(family) -> Reference:
    return Reference(str(family["a"]), "float64")


def running(local_cluster, deployment: str) -> list[str] | None:
    """The nodes of a deployment's replicas once Serve reports it HEALTHY (its replicas serve), else None."""
    from ray import serve

    status = serve.status().applications["cluster"].deployments[deployment]
    return replicas_by_node(local_cluster, "cluster").get(deployment) if status.status == "HEALTHY" else None


def recomputed(url: str, deployment: str) -> float:
    """Tokens a deployment's replicas recomputed for the router's calls (s2d_recomputed_tokens_total, all replicas)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    prefix = f's2d_recomputed_tokens_total{{deployment="{deployment}",'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def serving(url: str) -> bool:
    try:
        return httpx.get(url, headers=AUTH, timeout=5.0).status_code == 200
    except httpx.HTTPError:  # the proxy holds requests until the app's ingress has a replica
        return False


def completion(url: str, prompt: str, max_tokens: int) -> dict:
    resp = post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


class Stream(threading.Thread):
    """One streamed completion read in a thread: its token ids as they arrive, how it ended, and its errors."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.tokens: list[int] = []
        self.errors: list[dict] = []
        self.finish_reason: str | None = None
        self.done = False

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", content=json.dumps(body),
                          headers={"content-type": "application/json", **AUTH}, timeout=HTTP_TIMEOUT) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                choice = event["choices"][0]
                self.tokens += choice.get("token_ids") or []
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.done = True


def streams_across_a_node_loss(url: str, local_cluster, node: str) -> tuple[list[Stream], list[int]]:
    """Four concurrent streams; `node` is killed once every stream has tokens; (streams, tokens each had then)."""
    streams = [Stream(url, p) for p in PROMPTS]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.tokens for s in streams), timeout_s=120, interval_s=0.01)
    at_kill = [len(s.tokens) for s in streams]
    local_cluster.kill(node)
    for s in streams:
        s.join(timeout=240)
        assert s.done, "a stream hung"
    return streams, at_kill


def check_exact(streams: list[Stream], at_kill: list[int], reference: Reference) -> None:
    for s, before in zip(streams, at_kill):
        assert before < STREAM_TOKENS, "the node died after a stream had finished: nothing was in flight"
        assert not s.errors, s.errors
        assert s.finish_reason == "length" and len(s.tokens) == STREAM_TOKENS  # not ended early
        # Nothing repeated or skipped: exactly the uninterrupted target-only greedy continuation.
        assert s.tokens == reference.greedy(reference.ids(s.prompt), STREAM_TOKENS)


def test_placement_follows_the_configs_resources_and_outputs_are_exact(local_cluster, app, reference):
    placed = replicas_by_node(local_cluster, "cluster")
    assert set(placed) == {"router", "metrics", "draft", f"target-{MODEL}"}
    assert placed["router"] == ["head"] and placed["metrics"] == ["head"]  # the hub follows the routers' resources
    assert placed["draft"] in (["small-0"], ["small-1"]), placed  # either node of the draft's type
    assert placed[f"target-{MODEL}"] in (["large-0"], ["large-1"]), placed
    drafted = metric(app, f'vllm:spec_decode_num_accepted_tokens_total{{model="{MODEL}"}}')
    for prompt in PROMPTS:
        choice = completion(app, prompt, 48)["choices"][0]
        assert choice["token_ids"] == reference.greedy(reference.ids(prompt), 48)
    # The draft on its own node did the drafting: its tokens were accepted.
    assert metric(app, f'vllm:spec_decode_num_accepted_tokens_total{{model="{MODEL}"}}') > drafted


@pytest.mark.tp
def test_a_tp_targets_ranks_are_packed_on_one_node_away_from_its_router(local_cluster, family):
    """A TP-2 target: its replica and both ranks in one STRICT_PACK placement group on one `s2d_large_gpu` node, its
    router on the head; greedy output equals the target's own. (Fractions of the resource: the tiny app's target
    holds a whole one on its node, so the group goes to the other.)"""
    from ray import serve
    from ray.util.state import list_actors

    from s2d_ray.serve import build_app

    cfg = {"targets": [{"name": "tiny-tp", "source": str(family["a"]), "dtype": "float32", "tp_size": 2,
                        "num_cpus": 0.1, "tp_worker_cpus": 0.25, "resources": {"s2d_large_gpu": 0.1},
                        "tp_worker_resources": {"s2d_large_gpu": 0.1}}],
           "spec": {"mode": "ar"}, "router": {"num_cpus": 0.25, "resources": {"node:__internal_head__": 0.01}},
           "api_key": API_KEY, "num_threads": 1}
    url = deploy(build_app(cfg), "tp", local_cluster.port)
    try:
        placed = replicas_by_node(local_cluster, "tp")
        ranks = [local_cluster.node_name(a.node_id) for a in list_actors(
            address=local_cluster.dashboard, filters=[("state", "=", "ALIVE"), ("class_name", "=", "TPWorker")])]
        assert placed["router"] == ["head"]
        [node] = placed["target-tiny-tp"]
        assert node.startswith("large-") and ranks == [node, node], (placed, ranks)
        reference = Reference(str(family["a"]), "float32")
        out = post(f"{url}/v1/completions", {"model": "tiny-tp", "prompt": PROMPTS[0], "max_tokens": 24,
                                             "temperature": 0, "return_token_ids": True})
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == reference.greedy(reference.ids(PROMPTS[0]), 24)
    finally:
        serve.delete("tp")  # frees its share of the node for the node-loss tests below


def test_the_drafts_node_lost_mid_stream_streams_go_on_target_only_then_speculate_again(local_cluster, app,
                                                                                          reference):
    [lost] = replicas_by_node(local_cluster, "cluster")["draft"]
    spare = ({"small-0", "small-1"} - {lost}).pop()
    fallbacks = metric(app, f's2d:spec_decode_draft_fallback_rounds_total{{model="{MODEL}"}}')
    streams, at_kill = streams_across_a_node_loss(app, local_cluster, lost)
    check_exact(streams, at_kill, reference)
    assert metric(app, f's2d:spec_decode_draft_fallback_rounds_total{{model="{MODEL}"}}') > fallbacks
    # Serve starts the draft's replacement on the other node of its type; once it serves, rounds draft again.
    wait_until(lambda: running(local_cluster, "draft") == [spare], timeout_s=180, interval_s=1.0)
    want = reference.greedy(reference.ids(PROMPTS[1]), 32)

    def drafts_again() -> bool:
        out = completion(app, PROMPTS[1], 32)
        assert out["choices"][0]["token_ids"] == want
        return out["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0

    wait_until(drafts_again, timeout_s=60, interval_s=1.0)


def test_the_targets_node_lost_mid_stream_every_stream_resumes_exactly(local_cluster, app, reference):
    [lost] = replicas_by_node(local_cluster, "cluster")[f"target-{MODEL}"]
    spare = ({"large-0", "large-1"} - {lost}).pop()
    rebuilt = recomputed(app, f"target-{MODEL}")
    streams, at_kill = streams_across_a_node_loss(app, local_cluster, lost)
    check_exact(streams, at_kill, reference)
    # The replacement on the other node rebuilt the sequences from their prompts and committed tokens: a round in
    # flight when the node died was resent (s2d_target_failovers_total), one sent after it waited in Serve's queue.
    assert recomputed(app, f"target-{MODEL}") - rebuilt > sum(at_kill)  # prompts + what each had streamed then
    assert running(local_cluster, f"target-{MODEL}") == [spare]


def test_a_target_that_cannot_be_placed_is_a_503_with_retry_after(local_cluster, family):
    """A target whose resource no node has: requests end within its failover_s with a 503 and Retry-After."""
    from ray import serve

    from s2d_ray.serve import build_app

    cfg = app_config(family)
    cfg["targets"][0] = {**cfg["targets"][0], "resources": {"s2d_missing_gpu": 1}, "failover_s": 3.0}
    cfg.pop("draft")
    cfg["spec"] = {"mode": "ar"}
    url = deploy(build_app(cfg), "unplaced", local_cluster.port, wait=False)
    try:
        wait_until(lambda: serving(f"{url}/v1/models"), timeout_s=120, interval_s=1.0)  # the router is up
        start = time.monotonic()
        resp = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 8})
        assert time.monotonic() - start < 30.0
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["code"] == "service_unavailable"
    finally:
        serve.delete("unplaced", _blocking=False)
