"""Ray + Serve started ONCE per test session on 127.0.0.1, and the apps the serve tests share.

`tiny_app`: three float64 tiny targets (two models + a TP-2 copy of the first) sharing one trained-like sorted draft.
`real_app` (marked real): SmolLM2-135M-Instruct with an untrained cut draft.
Every wait is bounded: a deployment that cannot start fails the fixture instead of hanging the suite.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else Ray binds the external address, not loopback
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers import make_tiny_llama, make_tiny_tokenizer  # noqa: E402
from serve_helpers import API_KEY  # noqa: E402
from s2d_ray.core.draft import DraftSpec, SortedDraft  # noqa: E402
from s2d_ray.models.drafts import save_draft  # noqa: E402
from s2d_ray.core.decoder import decoder_parts  # noqa: E402

DEPLOY_TIMEOUT_S = 240
TINY_VOCAB = 320


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeApp:
    name: str
    url: str  # http://127.0.0.1:<port>/<prefix>
    handle: object
    config: dict


def save_tiny_family(root: Path) -> dict[str, Path]:
    """Two peaky float64 targets of one tokenizer (b = a + noise) and a noisy 3-layer sorted draft of a."""
    tok = make_tiny_tokenizer(TINY_VOCAB)
    a = make_tiny_llama(vocab_size=TINY_VOCAB, num_layers=4, seed=0, dtype=torch.float64)
    with torch.no_grad():
        a.model.embed_tokens.weight.mul_(4.0)
    b = copy.deepcopy(a)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in b.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    dirs = {"a": root / "tiny-a", "b": root / "tiny-b", "draft": root / "tiny-draft"}
    for key, model in (("a", a), ("b", b)):
        model.save_pretrained(dirs[key])
        tok.save_pretrained(dirs[key])
    layers = torch.nn.ModuleList(copy.deepcopy(list(a.model.layers)[:3]))
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.08)
    spec = DraftSpec(str(dirs["a"]), 3, [1, 2, 3], [0.05, 0.05, 0.0])
    save_draft(SortedDraft(decoder_parts(a), spec, layers), dirs["draft"], dtype=torch.float64)
    return dirs


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory) -> dict[str, Path]:
    return save_tiny_family(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="session")
def serve_instance():
    """One Ray + Serve for the whole session: HTTP on 127.0.0.1 and a free port."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=16, include_dashboard=False, object_store_memory=128 * 1024 * 1024,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    ray.shutdown()


def deploy(app, name: str, port: int, config: dict) -> ServeApp:
    """serve.run without its unbounded wait: poll status until RUNNING, fail on DEPLOY_FAILED or timeout."""
    from ray import serve

    serve._run(app, _blocking=False, name=name, route_prefix=f"/{name}")
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return ServeApp(name, f"http://127.0.0.1:{port}/{name}", serve.get_app_handle(name), config)
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"app {name} failed: {status.message} {status.deployments}")
        time.sleep(0.5)
    raise TimeoutError(f"app {name} not RUNNING after {DEPLOY_TIMEOUT_S} s: {serve.status().applications.get(name)}")


def undeploy(name: str) -> None:
    """Delete an app: a full suite would otherwise keep many apps alive on one machine, and Ray's memory monitor
    kills the Serve controller when the node nears its threshold."""
    from ray import serve

    serve.delete(name)


def tiny_config(dirs: dict[str, Path], **extra) -> dict:
    target = {"dtype": "float64", "num_cpus": 0.25}
    cfg = {
        "targets": [
            {"name": "tiny-a", "source": str(dirs["a"]), **target},
            {"name": "tiny-b", "source": str(dirs["b"]), "max_context": 128, **target},
            {"name": "tiny-tp", "source": str(dirs["a"]), "tp_size": 2, "tp_worker_cpus": 0.25,
             **target, "dtype": "float32"},
        ],
        "draft": {"source": str(dirs["draft"]), "dtype": "float64", "num_cpus": 0.25, "retry_after_s": 1.0,
                  # Wait for the other targets' rounds so the test sees them merge into one draft forward.
                  "max_batch_size": 3, "batch_wait_timeout_s": 0.05, "batch_wait_fraction": 1.0},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        # 448 tokens: the hang-up tests need a generation that outlasts a stats call on a fast (AVX512) host, where the
        # tiny target decodes 64 tokens in under 0.3 s; requests without max_tokens still get 64.
        "limits": {"max_tokens_limit": 448, "default_max_tokens": 64, "max_prompt_tokens": 400, "max_body_bytes": 4096,
                   "max_concurrent_sequences": 4, "max_queued_requests": 4, "max_choices": 6,
                   "max_prompt_logprobs_tokens": 64},
        "api_key": API_KEY,
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="session")
def tiny_app(serve_instance, tiny_family) -> ServeApp:
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    return deploy(build_app(cfg), "tiny", serve_instance, cfg)


def real_draft_source() -> str:
    """The committed default draft once it exists, else an untrained cut (exactness holds either way)."""
    from s2d_ray.build import COMMITTED_DRAFTS
    from s2d_ray.config import DEFAULT_DRAFT

    return DEFAULT_DRAFT if (COMMITTED_DRAFTS / DEFAULT_DRAFT).is_dir() else "cut:smollm2-135m-instruct:6"


@pytest.fixture(scope="module")
def real_app(serve_instance):
    """SmolLM2-135M-Instruct behind the default draft (or a cut of its first 6 layers)."""
    from s2d_ray.serve import build_app

    cfg = {
        # float32, not the `auto` default (bf16 on some CPUs): the tests compare with an fp32 reference token for token
        # No calibration profile: the test proves the served draft path exact on real weights, so it must draft; with
        # the profile, whether it drafts is this CPU's cost grid's call (on an AVX2 host in fp32 it never does).
        "targets": [{"name": "smollm2-135m-instruct", "num_cpus": 0.25, "dtype": "float32", "calibration": "off"}],
        "draft": {"source": real_draft_source(), "num_cpus": 0.25, "dtype": "float32"},
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), "real", serve_instance, cfg)
    undeploy("real")  # one module uses it: its replicas (torch and a model each) must not outlive the module


@pytest.fixture(scope="module")
def real_tp_app(serve_instance):
    """SmolLM2 tensor parallel over 3 AutoTP ranks (9 query / 3 KV heads), target-only (mode ar: no draft)."""
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "smollm2-tp3", "source": "smollm2-135m-instruct", "tp_size": 3, "num_cpus": 0.1,
                     "tp_worker_cpus": 0.25, "dtype": "float32"}],  # compared with an fp32 reference
        "spec": {"mode": "ar"},
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), "realtp", serve_instance, cfg)
    undeploy("realtp")  # one module uses it: its replicas (torch and a model each) must not outlive the module


@pytest.fixture(scope="module")
def faults_app(serve_instance, tiny_family):
    """A separate app whose replicas tests may kill: a tiny target, a TP-2 target and the draft. A lone target's
    propose calls are short (they never wait at the draft), so a kill seldom hits one in flight, and Serve holds the
    next calls until a replacement replica is up (seconds): a 2 s draft call timeout makes those rounds fall back
    to target-only, as a real outage would after `call_timeout_s`."""
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [
            {"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25},
            {"name": "tiny-tp", "source": str(tiny_family["a"]), "dtype": "float32", "tp_size": 2, "num_cpus": 0.1,
             "tp_worker_cpus": 0.25, "health_check_period_s": 1.0, "health_check_timeout_s": 5.0,
             "failover_s": 150.0},  # a broken group's rounds wait for the replacement group (its init included)
        ],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25, "retry_after_s": 0.5,
                  "call_timeout_s": 2.0, "max_batch_size": 2, "batch_wait_timeout_s": 0.05,
                  "health_check_period_s": 1.0},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 3},
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), "faults", serve_instance, cfg)
    undeploy("faults")  # one module uses it: its replicas (torch and a model each) must not outlive the module
