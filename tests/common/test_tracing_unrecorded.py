"""A request's span is recorded only when a span processor would receive it: without one (no exporter) the
span's context is the one the SDK would make (the trace continued, a new span id, the same flags), so the
``traceparent`` sent downstream is the same, but no span is built."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvfleet_common.server_kit.tracing import inject_headers, start_request_span

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ATTRIBUTES = {"kvfleet.tenant": "t", "http.request.method": "POST"}


def _traceparent(tracer: trace.Tracer, headers: dict[str, str]) -> tuple[bool, list[str]]:
    """(whether the request's span recorded, the traceparent's fields sent downstream)."""
    span = start_request_span(tracer, "route", headers, ATTRIBUTES)
    with trace.use_span(span, end_on_exit=False):
        sent = inject_headers({})["traceparent"].split("-")
    recording = span.is_recording()
    span.set_attribute("http.response.status_code", 200)
    span.end()
    return recording, sent


def test_without_a_processor_nothing_is_recorded_and_the_same_context_propagates():
    quiet = TracerProvider().get_tracer("t")
    exporter = InMemorySpanExporter()
    recording = TracerProvider()
    recording.add_span_processor(SimpleSpanProcessor(exporter))
    loud = recording.get_tracer("t")
    for headers in ({"traceparent": PARENT}, {}):  # a continued trace, and a new one
        recorded, sent = _traceparent(quiet, headers)
        assert not recorded
        recorded, expected = _traceparent(loud, headers)
        assert recorded
        assert sent[0] == expected[0] and sent[3] == expected[3]  # version, flags (sampled, random id)
        if headers:
            assert sent[1] == expected[1] == PARENT.split("-")[1]  # the client's trace continues
        assert sent[2] != PARENT.split("-")[2] and int(sent[2], 16) != 0  # a span of its own
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 and spans[0].attributes["kvfleet.tenant"] == "t"


def test_a_processor_added_later_gets_recorded_spans():
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    assert not _traceparent(tracer, {"traceparent": PARENT})[0]
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert _traceparent(tracer, {"traceparent": PARENT})[0]
    (span,) = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 200
    assert format(span.context.trace_id, "032x") == PARENT.split("-")[1]
