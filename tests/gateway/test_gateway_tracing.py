"""A trace started by the client continues through the gateway into the engine (OTLP exporters in each)."""

from __future__ import annotations

import time

import httpx

from tests.gateway.gateway_harness import MODEL, Fleet, wait_until
from tests.server.test_tracing import OTLPReceiver


def test_client_trace_continues_through_gateway_and_engine(demo_model, tmp_path):
    receiver = OTLPReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    trace_id, client_span = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    stream_trace_id = "6cf92f3577b34da6a3ce929d0e0e4738"
    try:
        with Fleet(demo_model("llama", "tiny"), tmp_path) as fleet:
            fleet.start_engines(1, env=env)
            g = fleet.start_gateway(env=env)
            key = g.create_tenant("traced")
            r = httpx.post(f"{g.url}/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-{client_span}-01"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 3})  # fmt: skip
            assert r.status_code == 200, r.text
            # a stream: its route span stays open until the last event, so the outcome and usage land on it
            with httpx.stream("POST", f"{g.url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key}",
                                       "traceparent": f"00-{stream_trace_id}-{client_span}-01"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "stream me"}],
                                    "max_tokens": 4, "stream": True}) as s:  # fmt: skip
                assert s.status_code == 200
                assert b"data: [DONE]" in b"".join(s.iter_bytes())

            def both_exported():
                names = {(s.trace_id.hex(), svc, s.name) for svc, s in receiver.spans}
                return all((t, "kvfleet-gateway", "kvfleet.gateway.route") in names
                           and (t, "kvfleet-engine", "engine chat") in names for t in (trace_id, stream_trace_id))  # fmt: skip

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
        server_kind = 2  # OTLP SPAN_KIND_SERVER: the route span is the request's server span
        assert spans[route][1].kind == server_kind
        chain = ancestors(engine)
        assert "kvfleet.gateway.route" in chain and chain[-1] == client_span, chain
        attrs = {a.key: a.value for a in spans[route][1].attributes}
        assert attrs["kvfleet.tenant"].string_value == "traced"
        assert attrs["kvfleet.replica"].string_value == r.headers["x-kvfleet-replica"]
        assert attrs["kvfleet.policy"].string_value == "prefix-aware"
        assert "matched_tokens" in attrs["kvfleet.candidates"].string_value
        assert attrs["http.response.status_code"].int_value == 200
        [stream_route] = [s for svc, s in receiver.spans
                          if s.trace_id.hex() == stream_trace_id and s.name == "kvfleet.gateway.route"]  # fmt: skip
        stream_attrs = {a.key: a.value for a in stream_route.attributes}
        assert stream_attrs["http.response.status_code"].int_value == 200
        assert 0 < stream_attrs["gen_ai.usage.output_tokens"].int_value <= 4  # metered although not asked for
        assert stream_route.end_time_unix_nano > stream_route.start_time_unix_nano
    finally:
        receiver.close()
