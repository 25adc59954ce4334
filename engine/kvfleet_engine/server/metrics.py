"""Prometheus metrics of one engine replica (names prefixed ``kvfleet_engine_``, and vLLM's ``vllm:``
names for the same values: ``vllm_metrics.py``).

Request-level figures (latencies, token counts, statuses) are observed in the API server as
requests stream; engine-level gauges (running/waiting, KV usage, prefix-cache hits, sleep) are
refreshed from the core's stats on every scrape. Each server has its own registry, so several
servers in one test process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet_common.server_kit.runtime_metrics import add_process_collectors, loop_lag_histogram
from kvfleet_engine.core.messages import CoreStats
from kvfleet_engine.server.vllm_metrics import VllmMetricsCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5,
                    10, 20, 40, 80)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.5)  # fmt: skip


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        add_process_collectors(r)
        self.loop_lag = loop_lag_histogram("kvfleet_engine", r)
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(
            "kvfleet_engine_requests", "Finished HTTP generation requests by endpoint and status code",
            ["model_name", "endpoint", "status"], registry=r,
        )  # fmt: skip
        self.finish_reasons = Counter(
            "kvfleet_engine_request_finish", "Finished sequences by finish reason",
            ["model_name", "finish_reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvfleet_engine_time_to_first_token_seconds", "Time from arrival to the first output token",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "kvfleet_engine_inter_token_latency_seconds", "Time between consecutive output deltas of a request",
            labels, buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "kvfleet_engine_e2e_request_latency_seconds", "Time from arrival to the last output token",
            labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvfleet_engine_prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        )
        self.generation_tokens = Counter(
            "kvfleet_engine_generation_tokens", "Generated tokens", labels, registry=r
        )
        self.cached_prompt_tokens = Counter(
            "kvfleet_engine_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            labels,
            registry=r,
        )
        self.running = Gauge("kvfleet_engine_num_requests_running", "Sequences running", labels, registry=r)
        self.waiting = Gauge("kvfleet_engine_num_requests_waiting", "Sequences waiting", labels, registry=r)
        self.kv_usage = Gauge(
            "kvfleet_engine_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)", labels, registry=r
        )
        self.num_kv_blocks = Gauge("kvfleet_engine_kv_cache_blocks", "KV cache blocks", labels, registry=r)
        self.num_free_kv_blocks = Gauge(
            "kvfleet_engine_kv_cache_free_blocks", "KV blocks no request holds", labels, registry=r
        )
        self.prefix_queries = Gauge(
            "kvfleet_engine_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache (cumulative)",
            labels, registry=r,
        )  # fmt: skip
        self.prefix_hits = Gauge(
            "kvfleet_engine_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache (cumulative)",
            labels, registry=r,
        )  # fmt: skip
        self.prefix_hit_rate = Gauge(
            "kvfleet_engine_prefix_cache_hit_rate",
            "Prefix-cache hit rate since start (tokens)",
            labels,
            registry=r,
        )
        self.preemptions = Gauge(
            "kvfleet_engine_num_preemptions", "Preemptions since start (cumulative)", labels, registry=r
        )
        self.prefill_rate = Gauge(
            "kvfleet_engine_prefill_tokens_per_second", "Measured prefill throughput", labels, registry=r
        )
        self.decode_rate = Gauge(
            "kvfleet_engine_decode_tokens_per_second", "Measured decode throughput", labels, registry=r
        )
        self.sleep_level = Gauge(
            "kvfleet_engine_sleep_level", "0 = awake, 1 or 2 = asleep at that level", labels, registry=r
        )
        self.device_memory = Gauge(
            "kvfleet_engine_device_memory_bytes",
            "Device memory held by the workers, by kind (weights, kv_cache)",
            ["model_name", "kind"],
            registry=r,
        )
        self.healthy = Gauge("kvfleet_engine_healthy", "1 while the engine core is alive", labels, registry=r)
        # The same values under vLLM's names, for gateways and tools that read those (vllm_metrics.py).
        r.register(VllmMetricsCollector(self))

    def update_from_stats(self, s: CoreStats, healthy: bool) -> None:
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_cache_usage)
        self.num_kv_blocks.labels(m).set(s.num_kv_blocks)
        self.num_free_kv_blocks.labels(m).set(s.num_free_kv_blocks)
        self.prefix_queries.labels(m).set(s.prefix_cache_queries)
        self.prefix_hits.labels(m).set(s.prefix_cache_hits)
        self.prefix_hit_rate.labels(m).set(
            s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        )
        self.preemptions.labels(m).set(s.num_preemptions)
        self.prefill_rate.labels(m).set(s.prefill_tokens_per_s)
        self.decode_rate.labels(m).set(s.decode_tokens_per_s)
        self.sleep_level.labels(m).set(s.sleep_level)
        self.device_memory.labels(m, "weights").set(s.weights_bytes)
        self.device_memory.labels(m, "kv_cache").set(s.kv_cache_bytes)
        self.healthy.labels(m).set(1 if healthy else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
