"""vLLM's metric names on a real engine server's /metrics: what Kubernetes inference gateways scrape.

The Gateway API Inference Extension's model-server protocol (its endpoint picker, and llm-d's scheduler on
it) reads a replica's queue, running requests, KV-cache utilisation and LoRA state by vLLM's names;
inference-perf's ``vllm`` server type and vLLM's dashboards read the latency histograms and token counters.
Each must be there, of the protocol's type, and carry the same value as the ``kvfleet_engine_*`` twin.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _scrape(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family, sample_name: str, **labels) -> float:
    values = [
        s.value
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(values) == 1, (sample_name, labels, family.samples)
    return values[0]


def test_a_scrape_has_what_the_inference_gateway_protocol_requires(server, client):
    for _ in range(2):
        client.completions.create(model=server.model, prompt="hello there", max_tokens=3)
    families = _scrape(server)

    # The protocol's metrics, by the names and types its endpoint picker reads.
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):  # fmt: skip
        assert families[name].type == "gauge", name
    assert (
        _value(families["vllm:num_requests_waiting"], "vllm:num_requests_waiting", model_name=server.model)
        == 0
    )
    usage = _value(families["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc", model_name=server.model)
    assert 0.0 <= usage <= 1.0  # a fraction, as vLLM's "perc" is
    assert usage == _value(
        families["kvfleet_engine_kv_cache_usage_ratio"], "kvfleet_engine_kv_cache_usage_ratio"
    )
    lora = families["vllm:lora_requests_info"]
    assert lora.type == "gauge"
    (sample,) = lora.samples
    assert sample.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert sample.value > 1.7e9  # a timestamp: the picker keeps the latest

    # Latency histograms and counters: the same observations as the kvfleet_engine_* twins.
    for vllm_name, ours in (
        ("vllm:time_to_first_token_seconds", "kvfleet_engine_time_to_first_token_seconds"),
        ("vllm:e2e_request_latency_seconds", "kvfleet_engine_e2e_request_latency_seconds"),
        ("vllm:inter_token_latency_seconds", "kvfleet_engine_inter_token_latency_seconds"),
    ):
        assert families[vllm_name].type == "histogram"
        count = _value(families[vllm_name], vllm_name + "_count", model_name=server.model)
        assert count >= 2 and count == _value(families[ours], ours + "_count")
        assert _value(families[vllm_name], vllm_name + "_bucket", model_name=server.model, le="+Inf") == count
    for vllm_name, ours in (
        ("vllm:prompt_tokens", "kvfleet_engine_prompt_tokens"),
        ("vllm:generation_tokens", "kvfleet_engine_generation_tokens"),
    ):
        assert families[vllm_name].type == "counter"
        total = _value(families[vllm_name], vllm_name + "_total", model_name=server.model)
        assert total >= 6 and total == _value(families[ours], ours + "_total")
    assert (
        _value(families["vllm:request_success"], "vllm:request_success_total", finished_reason="length") >= 2
    )
    assert families["vllm:prefix_cache_queries"].type == "counter"
    assert _value(families["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") >= _value(
        families["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total"
    )
