"""The engine continues the caller's trace: a W3C traceparent in, an OTLP span out (to a real receiver)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.server.server_harness import run_server


class OTLPReceiver:
    """A minimal OTLP/HTTP traces endpoint: decodes every export into spans."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = {a.key: a.value.string_value for a in rs.resource.attributes}.get(
                        "service.name"
                    )
                    for ss in rs.scope_spans:
                        receiver.spans += [(service, s) for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_request_span_continues_the_callers_trace(demo_model, tmp_path):
    receiver = OTLPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    try:
        with run_server(demo_model("llama", "tiny"), tmp_path, "--max-model-len", "256", env=env) as server:
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
            )
            assert r.status_code == 200
            deadline = time.monotonic() + 15
            while not receiver.spans and time.monotonic() < deadline:
                time.sleep(0.1)
        mine = {s.span_id.hex(): (svc, s) for svc, s in receiver.spans if s.trace_id.hex() == trace_id}
        [(service, span)] = [(svc, s) for svc, s in mine.values() if s.name == "engine chat"]
        assert service == "kvfleet-engine"
        # its ancestry (through FastAPI's HTTP server span, when FastAPI emits one) reaches the caller's span
        parent = span.parent_span_id.hex()
        while parent in mine:
            parent = mine[parent][1].parent_span_id.hex()
        assert parent == parent_id
        assert [e.name for e in span.events] == ["queued", "first_token", "finished"]
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs["gen_ai.usage.output_tokens"].int_value == 3
        assert attrs["gen_ai.usage.input_tokens"].int_value == r.json()["usage"]["prompt_tokens"]
        assert attrs["kvfleet.request_id"].string_value == r.headers["x-request-id"]
    finally:
        receiver.close()
