"""Shared by the reliability, soak and fuzz tests: extra apps deployed next to the session's (and deleted after),
code run inside a replica process (its pid, RSS, logging), Prometheus series, and raw SSE reads with any headers."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx

from serve_helpers import AUTH, HTTP_TIMEOUT, replica_actor

_SERVE_CONFTEST = Path(__file__).with_name("conftest.py")


def serve_conftest():
    """tests/serve/conftest.py as a module (pytest may have replaced `conftest` in sys.modules by another one)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == str(_SERVE_CONFTEST):
            return module
    spec = importlib.util.spec_from_file_location("serve_conftest", _SERVE_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_conftest"] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def deploy_app(app, name: str, port: int, config: dict):
    """Deploy under route prefix /<name> in the session's Serve, bounded (see conftest.deploy)."""
    return serve_conftest().deploy(app, name, port, config)


def delete_app(name: str) -> None:
    """Delete an app this module deployed: its replicas (torch and a model each) must not outlive the module."""
    from ray import serve

    serve.delete(name)


def in_replica(app: str, deployment: str, fn):
    """Run fn() inside the process of a deployment's (single) replica and return its result (fn must be a local
    function or lambda so that cloudpickle sends it by value)."""
    import ray

    return ray.get(replica_actor(app, deployment).__ray_call__.remote(lambda _actor: fn()), timeout=60)


def replica_memory_mib(app: str, deployment: str) -> float:
    """Resident memory of a replica process after a full GC and malloc_trim (freed memory handed back to the OS),
    so that before/after figures compare live memory, not allocator high-water marks."""

    def measure() -> float:
        import gc

        import psutil

        from s2d_ray.serve.replica import return_freed_memory

        gc.collect()
        return_freed_memory()
        return psutil.Process().memory_info().rss / 2**20

    return in_replica(app, deployment, measure)


def metric(url: str, series: str, headers: dict | None = None) -> float:
    """The value of one Prometheus series of the app (0 when it does not exist yet); `headers`: an operator key."""
    resp = httpx.get(f"{url}/metrics", headers=AUTH if headers is None else headers, timeout=HTTP_TIMEOUT)
    assert resp.status_code == 200, resp.text  # a refused scrape must not read as 0
    text = resp.text
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def stream_events(url: str, body: dict, headers: dict) -> tuple[int, list]:
    """POST a streaming request; (status, events) with each `data:` event parsed ("[DONE]" kept as a string) or,
    when the status is not 200, the error body as the only event."""
    hdrs = {"content-type": "application/json", **headers}
    with httpx.stream("POST", url, content=json.dumps({**body, "stream": True}), headers=hdrs,
                      timeout=HTTP_TIMEOUT) as resp:
        if resp.status_code != 200:
            return resp.status_code, [json.loads(resp.read())]
        events = [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                  for line in resp.iter_lines() if line.startswith("data: ")]
    return 200, events


def logs_dir() -> Path:
    """This Ray session's log directory (not /tmp/ray/session_latest: other Ray sessions may run on the machine)."""
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def files_containing(root: Path, needles: list[str]) -> dict[str, list[str]]:
    """needle -> the files under root whose bytes contain it."""
    found: dict[str, list[str]] = {n: [] for n in needles}
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for n in needles:
            if n.encode() in data:
                found[n].append(str(path))
    return found
