"""A trace started by the client continues through the gateway into the engine (OTLP exporters in each)."""

from __future__ import annotations

import time

import httpx
from gateway_harness import MODEL, Fleet, wait_until
from test_tracing import OTLPReceiver  # tests/server


def test_client_trace_continues_through_gateway_and_engine(demo_model, tmp_path):
    receiver = OTLPReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    trace_id, client_span = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    try:
        with Fleet(demo_model("llama", "tiny"), tmp_path) as fleet:
            fleet.start_engines(1, env=env)
            g = fleet.start_gateway(env=env)
            key = g.create_tenant("traced")
            r = httpx.post(f"{g.url}/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-{client_span}-01"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 3})  # fmt: skip
            assert r.status_code == 200, r.text

            def both_exported():
                names = {(svc, s.name) for svc, s in receiver.spans if s.trace_id.hex() == trace_id}
                return ("kvfleet-gateway", "kvfleet.gateway.route") in names and any(
                    svc == "kvfleet-engine" and n == "engine chat" for svc, n in names
                )

            wait_until(both_exported, 20, 0.1, "spans from both processes")
            time.sleep(0.3)  # the HTTP server spans end last; give them one more export interval
        spans = {s.span_id.hex(): (svc, s) for svc, s in receiver.spans if s.trace_id.hex() == trace_id}

        def ancestors(span_id: str) -> list[str]:
            out = []
            while span_id in spans:
                out.append(spans[span_id][1].name)
                span_id = spans[span_id][1].parent_span_id.hex()
            out.append(span_id)  # the first id outside the exported set: the client's span
            return out

        [route] = [sid for sid, (svc, s) in spans.items() if s.name == "kvfleet.gateway.route"]
        [engine] = [sid for sid, (svc, s) in spans.items() if s.name == "engine chat"]
        assert ancestors(route)[-1] == client_span
        chain = ancestors(engine)
        assert "kvfleet.gateway.route" in chain and chain[-1] == client_span, chain
        attrs = {a.key: a.value for a in spans[route][1].attributes}
        assert attrs["kvfleet.tenant"].string_value == "traced"
        assert attrs["kvfleet.replica"].string_value == r.headers["x-kvfleet-replica"]
        assert attrs["kvfleet.policy"].string_value == "prefix-aware"
        assert "matched_tokens" in attrs["kvfleet.candidates"].string_value
    finally:
        receiver.close()
