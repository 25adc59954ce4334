"""vLLM's metric names on the engine's ``/metrics``, from the same values as the ``kvfleet_engine_*`` ones.

Kubernetes inference gateways read a model server's load by vLLM's names: the Gateway API Inference
Extension's endpoint picker (and llm-d's scheduler on it) scrapes ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before vLLM
0.10) and ``vllm:lora_requests_info``; inference-perf's ``vllm`` server type and vLLM's Grafana dashboards
read the latency histograms and token counters. With these a kvfleet replica can sit behind any of them as
a vLLM replica does.

Nothing is observed twice: a collector re-labels, at scrape time, the samples of the metrics the server
already keeps (same buckets, same counts). Cumulative figures the engine core reports as totals (tokens
looked up in and served from the prefix cache, preemptions) are counters here, as in vLLM. The ``perc``
gauges are fractions in 0..1, as vLLM's are despite the name. There are no LoRA adapters:
``vllm:lora_requests_info`` says so (none running or waiting, ``max_lora`` 0), so a LoRA-affinity scorer
reads "none" rather than a missing metric.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class VllmMetricsCollector(Collector):
    def __init__(self, metrics: object) -> None:
        """``metrics``: the server's ``EngineMetrics`` (not imported: it registers this collector)."""
        self.started = time.time()
        m = metrics
        # (source, vLLM family name, vLLM type, documentation); several names for one source are aliases
        # some readers still use.
        self.mapping: list[tuple[MetricWrapperBase, str, str, str]] = [
            (m.running, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
            (m.waiting, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
            (m.kv_usage, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
            (m.kv_usage, "vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage (the name before vLLM 0.10)."),
            (m.ttft, "vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token."),
            (m.itl, "vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency."),
            (m.itl, "vllm:time_per_output_token_seconds", "histogram", "Histogram of time per output token."),
            (m.e2e, "vllm:e2e_request_latency_seconds", "histogram", "Histogram of end to end request latency."),
            (m.prompt_tokens, "vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
            (m.generation_tokens, "vllm:generation_tokens", "counter", "Number of generation tokens processed."),
            (m.preemptions, "vllm:num_preemptions", "counter", "Cumulative number of preemptions."),
            (m.prefix_queries, "vllm:prefix_cache_queries", "counter", "Prefix-cache queries, in tokens."),
            (m.prefix_hits, "vllm:prefix_cache_hits", "counter", "Prefix-cache hits, in tokens."),
            (m.finish_reasons, "vllm:request_success", "counter", "Count of finished requests by reason."),
        ]  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        for source, name, kind, documentation in self.mapping:
            yield from _renamed(source, name, kind, documentation)
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (this server serves no adapters).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], self.started)
        yield lora


def _renamed(source: MetricWrapperBase, name: str, kind: str, documentation: str) -> Iterator[Metric]:
    """``source``'s samples under ``name`` (``_created`` left out). A gauge kept as a running total becomes
    a counter (its sample gets ``_total``); ``finish_reason`` is vLLM's ``finished_reason``."""
    for family in source.collect():
        out = Metric(name, documentation, kind)
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            if suffix == "_created":
                continue
            if kind == "counter" and family.type == "gauge":
                suffix = "_total"
            labels = dict(sample.labels)
            if "finish_reason" in labels:
                labels["finished_reason"] = labels.pop("finish_reason")
            out.add_sample(name + suffix, labels, sample.value)
        yield out
