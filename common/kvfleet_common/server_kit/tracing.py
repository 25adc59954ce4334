"""OpenTelemetry set-up shared by every component, configured by the standard ``OTEL_*`` variables.

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (default when an OTLP endpoint is set), ``console`` or ``none``;
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: OTLP over HTTP/protobuf;
- ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``: resource attributes (read by the SDK).

With nothing set no exporter is installed, yet a real TracerProvider still runs so W3C
``traceparent`` headers are extracted and propagated (a gateway span's child lands in the engine).

A request's span is recorded only when a span processor would receive it (``start_request_span``). With none
(no exporter), the span's context is made as the SDK makes it (the trace continued, a new span id, the
sampler's decision in its flags), so what propagates downstream is the same, but nothing else is built: a
recorded span, its attributes cleaned one by one, cost ~0.1 ms of the gateway's CPU per request, a tenth of it
(docs/BENCHMARKS.md, "Gateway CPU per request").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

_configured = False


def _exporter_from_env() -> SpanExporter | None:
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    has_endpoint = bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if choice == "none" or (not choice and not has_endpoint):
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    if choice not in ("", "otlp"):
        raise ValueError(f"OTEL_TRACES_EXPORTER={choice!r} is not supported (use otlp, console or none)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # reads the endpoint, headers and timeout from OTEL_EXPORTER_OTLP_*


def setup_tracing(service_name: str) -> TracerProvider:
    """Install the global TracerProvider once per process (later calls return it unchanged)."""
    global _configured
    if _configured:
        return trace.get_tracer_provider()  # type: ignore[return-value]
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    exporter = _exporter_from_env()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def start_request_span(
    tracer: trace.Tracer, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
) -> trace.Span:
    """The span of one served request: its server span, continuing the caller's trace (``traceparent``), or,
    when an HTTP instrumentation already opened a server span for the request, that span's child."""
    nested = trace.get_current_span().get_span_context().is_valid
    context = None if nested else extract_context(headers)
    kind = trace.SpanKind.INTERNAL if nested else trace.SpanKind.SERVER
    unrecorded = _unrecorded_span(tracer, name, context, kind, attributes)
    if unrecorded is not None:
        return unrecorded
    return tracer.start_span(name, context=context, kind=kind, attributes=attributes)


def _unrecorded_span(
    tracer: trace.Tracer, name: str, context: Context | None, kind: trace.SpanKind, attributes: Mapping[str, Any],
) -> trace.Span | None:  # fmt: skip
    """The span ``tracer.start_span`` would start, as a ``NonRecordingSpan`` (same trace id, a new span id,
    the sampler's flags and trace state), when the SDK's tracer has no span processor to hand a recorded span
    to; None otherwise (a processor, the SDK disabled, another SDK, the tracer turned off: the real call)."""
    real = getattr(tracer, "_tracer", tracer)  # a ProxyTracer's delegate (the global provider's tracer)
    if not isinstance(real, sdk_trace.Tracer):
        return None
    if getattr(real.span_processor, "_span_processors", None) != () or not real._is_enabled():
        return None
    parent = trace.get_current_span(context).get_span_context()
    if parent.is_valid:
        trace_id, random_id = parent.trace_id, parent.trace_flags.random_trace_id
    else:
        trace_id, random_id = real.id_generator.generate_trace_id(), real.id_generator.is_trace_id_random()
    decision = real.sampler.should_sample(context, trace_id, name, kind, attributes, ())
    flags = trace.TraceFlags.SAMPLED if decision.decision.is_sampled() else trace.TraceFlags.DEFAULT
    if random_id:
        flags |= trace.TraceFlags.RANDOM_TRACE_ID
    span_context = trace.SpanContext(trace_id, real.id_generator.generate_span_id(), is_remote=False,
                                     trace_flags=trace.TraceFlags(flags), trace_state=decision.trace_state)  # fmt: skip
    return trace.NonRecordingSpan(span_context)


def extract_context(headers: Mapping[str, str]) -> Context:
    """The remote parent carried by W3C ``traceparent``/``tracestate`` headers (empty if none)."""
    return propagate.extract(dict(headers))


def inject_headers(headers: dict[str, str], context: Context | None = None) -> dict[str, str]:
    """Add ``traceparent`` (and ``tracestate``) for the current span to outgoing headers."""
    propagate.inject(headers, context=context)
    return headers


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
