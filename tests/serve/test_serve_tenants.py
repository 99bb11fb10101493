"""Tenants on the served app: keys from a keys file (sha256 digests), each naming a tenant. Under the default
isolation a tenant gets no prefix-cache hit and no match in the store of earlier outputs from another tenant's
prompt or output, while its own repeat does get both; `cache_salt` separates within a tenant; under `shared` (the
negative control) the other tenant's request does hit. Outputs are target-only greedy throughout. /stats and /metrics
need an operator's key. Also: /health is local liveness, and readiness is per model (one target down leaves the
other ready), and a queued stream keeps its connection alive."""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, Reference, post, replica_actor, wait_until

pytestmark = pytest.mark.serve

SYSTEM = " ".join(f"tenant rule {i}: reply with {i * 5 % 13} words;" for i in range(8))
ALICE, BOB = "alice-key-0001", "bob-key-0002"


def keys_file(tmp_path) -> str:
    path = tmp_path / "keys.yaml"
    lines = ["keys:"] + [f"  - {{tenant: {t}, sha256: {hashlib.sha256(k.encode()).hexdigest()}}}"
                         for t, k in (("alice", ALICE), ("bob", BOB))]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def tenant_app(serve_instance, tiny_family, tmp_path_factory, name: str, isolation: str):
    from conftest import deploy, tiny_config
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    cfg["targets"] = cfg["targets"][:2]  # tiny-a and tiny-b, no TP copy
    cfg["spec"] = {"mode": "lookup"}  # prompt lookup and the store: no draft deployment to start
    cfg["suffix"] = {"enabled": True, "max_tokens": 4096}
    cfg["tenants"] = {"keys_file": keys_file(tmp_path_factory.mktemp(name)), "isolation": isolation}
    cfg["limits"] = {**cfg["limits"], "max_concurrent_sequences": 1}  # one decode slot: a second request queues
    cfg["router"] = {**cfg["router"], "keepalive_s": 0.2}
    return deploy(build_app(cfg), name, serve_instance, cfg)


@pytest.fixture(scope="module")
def isolated_app(serve_instance, tiny_family, tmp_path_factory):
    from conftest import undeploy

    yield tenant_app(serve_instance, tiny_family, tmp_path_factory, "tenants", "tenant")
    undeploy("tenants")


@pytest.fixture(scope="module")
def shared_app(serve_instance, tiny_family, tmp_path_factory):
    from conftest import undeploy

    yield tenant_app(serve_instance, tiny_family, tmp_path_factory, "shared", "shared")
    undeploy("shared")


@pytest.fixture(scope="module")
def want(tiny_family) -> str:
    ref = Reference(str(tiny_family["a"]), "float64")
    return ref.text(ref.greedy(ref.ids(SYSTEM), 24))


def figures(app) -> tuple[int, int]:
    """tiny-a's prefix-cache hits (tokens, every replica) and store matches, from the operator's view."""
    body = httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()["targets"]["tiny-a"]
    return body["prefix_cache"]["prefix_cache_hits"], body["suffix"]["suffix_matches"]


def complete(app, key: str, **extra) -> str:
    r = post(f"{app.url}/v1/completions", {"model": "tiny-a", "prompt": SYSTEM, "max_tokens": 24, "temperature": 0,
                                           **extra}, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_tenant_never_hits_another_tenants_prefix_or_outputs(isolated_app, want):
    assert complete(isolated_app, ALICE) == want
    hits, matches = figures(isolated_app)
    assert complete(isolated_app, BOB) == want
    assert figures(isolated_app) == (hits, matches)  # nothing of alice's prompt or output reached bob
    assert complete(isolated_app, ALICE, cache_salt="s1") == want
    assert figures(isolated_app) == (hits, matches)  # another salt of alice's: nothing either
    assert complete(isolated_app, ALICE) == want
    now_hits, now_matches = figures(isolated_app)
    assert now_hits - hits >= 40 and now_matches > matches  # alice's own repeat hits both (the rule is not "never")


def test_shared_isolation_lets_another_tenant_hit(shared_app, want):
    """The negative control: the same requests under `isolation: shared` do reach across tenants."""
    assert complete(shared_app, ALICE) == want
    hits, matches = figures(shared_app)
    assert complete(shared_app, BOB) == want
    now_hits, now_matches = figures(shared_app)
    assert now_hits - hits >= 40 and now_matches > matches
    before = figures(shared_app)
    assert complete(shared_app, BOB, cache_salt="s1") == want
    assert figures(shared_app) == before  # cache_salt still separates


def test_operator_surfaces_need_an_operator_key(isolated_app):
    tenant = {"authorization": f"Bearer {ALICE}"}
    for path in ("/stats", "/metrics"):
        assert httpx.get(f"{isolated_app.url}{path}", timeout=HTTP_TIMEOUT).status_code == 401
        r = httpx.get(f"{isolated_app.url}{path}", headers=tenant, timeout=HTTP_TIMEOUT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert httpx.get(f"{isolated_app.url}{path}", headers=AUTH, timeout=HTTP_TIMEOUT).status_code == 200
    assert post(f"{isolated_app.url}/v1/completions", {"model": "tiny-a", "prompt": "x", "max_tokens": 1},
                headers={"authorization": "Bearer " + hashlib.sha256(ALICE.encode()).hexdigest()}).status_code == 401
    health = httpx.get(f"{isolated_app.url}/health", timeout=HTTP_TIMEOUT)
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # liveness: nothing else, no key


def test_one_target_down_leaves_the_other_ready(shared_app):
    import ray

    def ready() -> tuple[int, dict]:
        r = httpx.get(f"{shared_app.url}/health/ready", timeout=HTTP_TIMEOUT)
        return r.status_code, r.json()

    status, body = ready()
    assert status == 200 and body["status"] == "ready", body
    assert httpx.get(f"{shared_app.url}/health/ready/tiny-b", timeout=HTTP_TIMEOUT).status_code == 200
    assert httpx.get(f"{shared_app.url}/health/ready/nope", timeout=HTTP_TIMEOUT).status_code == 404
    ray.kill(replica_actor("shared", "target-tiny-b"), no_restart=True)
    status, body = wait_until(lambda: (lambda s, b: (s, b) if not b["models"]["tiny-b"]["ready"] else None)(*ready()),
                              timeout_s=30, interval_s=0.1)
    assert status == 200 and body["status"] == "degraded" and body["models"]["tiny-a"]["ready"], body
    assert httpx.get(f"{shared_app.url}/health/ready/tiny-a", timeout=HTTP_TIMEOUT).status_code == 200
    b = httpx.get(f"{shared_app.url}/health/ready/tiny-b", timeout=HTTP_TIMEOUT)
    assert b.status_code in (503, 200)  # 503 unless the replacement is already up
    assert "127.0.0.1" not in str(body) and "pid" not in str(body)  # no details without a key
    wait_until(lambda: ready()[1]["status"] == "ready", timeout_s=120, interval_s=0.5)


def test_a_queued_stream_keeps_its_connection_alive(isolated_app, want):
    """One long request holds the only decode slot; a stream queued behind it gets status 200 and `: keep-alive`
    comment lines at once, then its tokens (the same text)."""
    alice = {"authorization": f"Bearer {ALICE}"}
    long_body = {"model": "tiny-a", "prompt": "a long one", "max_tokens": 448, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, f"{isolated_app.url}/v1/completions", long_body, alice)
        time.sleep(0.3)  # admitted: it holds the slot
        body = {"model": "tiny-a", "prompt": SYSTEM, "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{isolated_app.url}/v1/completions", content=json.dumps(body),
                          headers={"content-type": "application/json", **alice}, timeout=HTTP_TIMEOUT) as resp:
            assert resp.status_code == 200
            lines = [ln for ln in resp.iter_lines() if ln]
        assert long.result().status_code == 200
    first = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert first > 0 and all(ln == ": keep-alive" for ln in lines[:first]), lines[:first + 1]
    chunks = [json.loads(ln[6:]) for ln in lines[first:] if ln != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want and lines[-1] == "data: [DONE]"
