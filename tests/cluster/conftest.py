"""The cluster tests' fixture: a head and four worker nodes on 127.0.0.1 (cluster_helpers.py), with Serve.

These tests need Ray to themselves: the fixture starts its own cluster and shuts it down at the end of the module,
and pytest runs tests/cluster before tests/serve, whose session-wide one-node Ray starts later.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# As tests/serve: every address Ray picks is loopback (ray.cluster_utils adds the worker nodes itself, so the check
# of `ray start --address` that this setting trips does not apply; scripts/local_cluster.sh sets 1 and binds each
# node with --node-ip-address instead), and no token.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serve"))  # serve_helpers, reliability_helpers

from cluster_helpers import free_port, start_cluster  # noqa: E402


@pytest.fixture(scope="module")
def local_cluster():
    """Head + 4 worker nodes, Serve's HTTP proxy on the head only, on 127.0.0.1 and a free port."""
    import ray
    from ray import serve

    local = start_cluster()
    try:
        local.port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": local.port})
        yield local
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            local.cluster.shutdown()
