"""The metrics hub (serve/metrics_hub.py): sums every router replica's last snapshot, so a counter never goes down
when scrapes land on different routers or a router leaves; gauges count only routers heard from lately; the
targets' prefix-cache counters are counted once however many routers report them."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from s2d_ray.serve import metrics_hub
from s2d_ray.serve.metrics import ServeMetrics
from s2d_ray.serve.metrics_hub import MetricsHub, snapshot


def value(text: bytes, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text.decode(), re.M)
    return float(m.group(1)) if m else 0.0


DONE = 'vllm:request_success_total{finished_reason="stop",model="m"}'
RUNNING = 'vllm:num_requests_running{model="m"}'


def finished(m: ServeMetrics, n: int) -> None:
    for _ in range(n):
        m.record_finished("m", 5, "stop", {"num_generated_tokens": 3, "num_draft_tokens": 4,
                                           "num_accepted_draft_tokens": 2, "num_spec_steps": 1,
                                           "num_target_forwards": 2, "exit_histogram": {},
                                           "accepted_exit_histogram": {},
                                           "mean_acceptance_length": 1.5}, 0.1, 0.01)


def test_counters_sum_over_routers_and_survive_one_leaving(monkeypatch):
    a, b, hub = ServeMetrics(), ServeMetrics(), MetricsHub()
    finished(a, 3)
    finished(b, 2)
    a.running.labels("m").set(1)
    b.running.labels("m").set(2)
    hub.push("a", snapshot(a.registry))
    hub.push("b", snapshot(b.registry))
    text = hub.render(None, {})
    assert value(text, DONE) == 5 and value(text, RUNNING) == 3
    assert value(text, 'vllm:e2e_request_latency_seconds_count{model="m"}') == 5
    # the negative control: one router's own registry, what a scrape used to get from whichever router answered
    assert value(generate_latest(b.registry), DONE) == 2
    monkeypatch.setattr(metrics_hub, "GAUGE_STALE_S", -1.0)  # router b gone quiet: its gauges drop, counters stay
    finished(a, 1)
    hub.push("a", snapshot(a.registry))
    text = hub.render(None, {})
    assert value(text, DONE) == 6 and value(text, RUNNING) == 0


def test_prefix_counters_are_counted_once_by_replica_increase():
    hub = MetricsHub()
    target = {"replica": "t0", "prefix_cache_queries": 100, "prefix_cache_hits": 40}
    for _ in range(3):  # three scrapes (through any routers) of the same cumulative counts
        text = hub.render(None, {"m": [target]})
    assert value(text, 'vllm:prefix_cache_hits_total{model="m"}') == 40
    text = hub.render(None, {"m": [{**target, "prefix_cache_hits": 50}, {"replica": "t1", "prefix_cache_queries": 9,
                                                                        "prefix_cache_hits": 7}]})
    assert value(text, 'vllm:prefix_cache_hits_total{model="m"}') == 57
