"""Prometheus metrics of the router, named in vLLM's style (`vllm:spec_decode_num_accepted_tokens_total`, ...).

One registry per router replica, summed over every router replica by the app's metrics hub (metrics_hub.py) and
served at /metrics; every series carries the target as `model`, exit counters also the draft exit layer as `exit`
(`0`: prompt-lookup candidates).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
CALL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
MAT_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12, 17)


DRAFT_GAUGES = {
    "num_calls": "Propose calls the draft replica received (one per target round).",
    "num_forwards": "Draft forwards (one per batch of merged calls).",
    "num_rows": "Sequences drafted, summed over forwards.",
    "num_merged_forwards": "Draft forwards that carried rows of more than one target.",
    "num_merged_rows": "Sequences drafted in forwards that carried rows of more than one target.",
    "rows_per_forward": "Mean sequences per draft forward.",
    "busy_s": "Seconds the draft's model thread spent drafting.",
    "busy_fraction": "Draft model-thread busy seconds over wall seconds, last 10 s (add replicas above ~0.7).",
    "queue_delay_s": "Seconds from propose calls' arrival to their forward's start, summed over calls.",
    "mean_queue_delay_s": "Mean seconds from a propose call's arrival to its forward's start.",
    "forward_s": "Recent mean duration of one draft forward.",
    "batch_wait_timeout_s": "The adaptive batching window the draft uses now.",
}


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m, me = self.registry, ["model"], ["model", "exit"]
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=r)
        self.emitted_tokens = Counter("vllm:spec_decode_num_emitted_tokens",
                                      "Tokens emitted by verification rounds (accepted + the target's own).", m,
                                      registry=r)
        self.spec_steps = Counter("s2d:spec_decode_num_spec_steps", "Rounds that verified draft tokens.", m, registry=r)
        self.target_forwards = Counter("s2d:spec_decode_num_target_forwards", "Target verification forwards.", m,
                                       registry=r)
        self.exit_draft = Counter("s2d:spec_decode_num_draft_tokens_by_exit", "Draft tokens proposed per exit.", me,
                                  registry=r)
        self.exit_accepted = Counter("s2d:spec_decode_num_accepted_tokens_by_exit", "Draft tokens accepted per exit.",
                                     me, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by depth in the round (position 0 = first).",
                                        ["model", "position"], registry=r)
        self.draft_fallbacks = Counter("s2d:spec_decode_draft_fallback_rounds",
                                       "Rounds decoded target-only because the draft deployment failed.", m, registry=r)
        self.target_failovers = Counter(
            "s2d_target_failovers", "Calls to a target resent because the replica holding them was lost (process, "
            "node or TP group).", m, registry=r)
        self.recomputed_tokens = Counter(
            "s2d_recomputed_tokens", "Tokens whose KV a replica recomputed because its cache did not hold the prefix "
            "(the sequence moved there, or its row was reclaimed); this router's calls.", ["deployment", "replica"],
            registry=r)
        self.call_overhead = Histogram(
            "s2d:call_overhead_seconds", "Per round call to a deployment: wall seconds minus the seconds the replica "
            "spent on it (Ray transport, batching, event loops): what a served round pays over an in-process one.",
            ["model", "deployment"], buckets=CALL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model", "finished_reason"], registry=r)
        self.aborts = Counter("s2d:request_aborts", "Requests aborted before finishing (client gone, timeout, error).",
                              ["model", "reason"], registry=r)
        self.errors = Counter("s2d:request_errors", "Failed requests by HTTP status.", ["model", "status"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Sequences being decoded.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a decode slot.", m, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", m, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m, buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.", m,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.mat = Histogram("s2d:request_mean_acceptance_length", "Tokens per target forward (bonus included).", m,
                             buckets=MAT_BUCKETS, registry=r)
        # The shared draft replica's capacity, read from its stats when /metrics is scraped (one replica answers).
        self.draft = {key: Gauge(f"s2d:draft_{key}", doc, registry=r) for key, doc in DRAFT_GAUGES.items()}
        # vLLM's prefix cache counters (tokens), summed over the target replicas that answered a scrape's stats call.
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "prefilled).", m, registry=r)
        self._prefix_seen: dict[tuple[str, str, str], int] = {}  # (model, replica, key) -> that replica's last count

    def record_finished(self, model: str, prompt_tokens: int, finish_reason: str, metrics: dict,
                        e2e_s: float, ttft_s: float | None) -> None:
        """Fold one finished request's engine metrics (SequenceMetrics.to_dict()) into the counters; latencies are
        measured by the router from arrival (queueing included), not from the engine's admission."""
        self.requests.labels(model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(metrics["num_generated_tokens"])
        self.draft_tokens.labels(model).inc(metrics["num_draft_tokens"])
        self.accepted_tokens.labels(model).inc(metrics["num_accepted_draft_tokens"])
        self.emitted_tokens.labels(model).inc(metrics["num_generated_tokens"])
        self.spec_steps.labels(model).inc(metrics["num_spec_steps"])
        self.target_forwards.labels(model).inc(metrics["num_target_forwards"])
        for layer, n in metrics["exit_histogram"].items():
            self.exit_draft.labels(model, layer).inc(n)
        for layer, n in metrics["accepted_exit_histogram"].items():
            self.exit_accepted.labels(model, layer).inc(n)
        for pos, n in enumerate(metrics.get("num_accepted_tokens_per_pos", [])):
            self.accepted_per_pos.labels(model, str(pos)).inc(n)
        self.e2e.labels(model).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
            n = metrics["num_generated_tokens"]
            if n > 1:
                self.tpot.labels(model).observe((e2e_s - ttft_s) / (n - 1))
        if metrics["num_target_forwards"]:
            self.mat.labels(model).observe(metrics["mean_acceptance_length"])

    def record_draft(self, stats: dict | None) -> None:
        """Copy the draft replica's stats (DraftDeployment.stats) into the gauges; skipped when unavailable."""
        if not stats or "error" in stats:
            return
        for key, gauge in self.draft.items():
            if key in stats:
                gauge.set(stats[key])

    def record_prefix_cache(self, model: str, stats: dict | None) -> None:
        """Fold a target replica's cumulative prefix cache counts (TargetDeployment.stats) into the counters by the
        increase since that replica last answered (a restarted replica starts again from 0)."""
        if not stats or "error" in stats or "prefix_cache_queries" not in stats:
            return
        replica = str(stats.get("replica", ""))
        for key, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits)):
            now, last = int(stats[key]), self._prefix_seen.get((model, replica, key), 0)
            counter.labels(model).inc(now - last if now >= last else now)
            self._prefix_seen[(model, replica, key)] = now

    def render(self) -> bytes:
        return generate_latest(self.registry)


PREFIX_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_tokens", "prefix_cache_max_tokens")


def prefix_cache_totals(replicas: list[dict]) -> dict:
    """One target's prefix cache counters summed over the replicas that answered (each replica's stats once)."""
    seen = {str(s.get("replica", i)): s for i, s in enumerate(replicas) if s and "error" not in s}
    totals = {key: sum(int(s.get(key, 0)) for s in seen.values()) for key in PREFIX_COUNTERS}
    failed = [s["error"] for s in replicas if s and "error" in s]
    return {**totals, "replicas": len(seen), **({"failed": failed} if failed else {})}
