"""OpenTelemetry tracing behind a flag (``--trace-endpoint``; extra ``rtserve[tracing]``).

Nothing runs on the hot path while a request is served: each stage already leaves a
``perf_counter_ns`` timestamp in the request's ``Timings``. When the answer has been sent,
``record`` turns them into a span tree with explicit start and end times: the request span
(continuing the client's W3C ``traceparent``) with children decode, cache, queue, compute
and encode. A batch gets one span of its own; the compute span of every request in it links
to that span. Off, the cost is one ``is None`` test per request; sampled out, it is one
sampler decision.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from rtserve.protocol.types import Timings

_MAX_BATCHES = 1024  # recent batch spans kept for linking


class Tracer:
    def __init__(self, endpoint: str, ratio: float = 1.0, service: str = "rtserve") -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "tracing needs the tracing extra: pip install 'rtserve[tracing]'"
            ) from exc
        self._trace = trace
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            # Root traces are sampled here (``record``), before any OpenTelemetry call, so an
            # unsampled request costs one random number; a client's traceparent decides
            # for its own trace.
            sampler=ParentBased(ALWAYS_ON),
        )
        self.ratio = ratio
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("rtserve")
        self.propagator = TraceContextTextMapPropagator()
        self.offset_ns = time.time_ns() - time.perf_counter_ns()
        self._batches: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def _at(self, perf_ns: int) -> int:
        return perf_ns + self.offset_ns

    def record(
        self,
        t: Timings,
        model: str,
        version: str,
        status: int,
        error: str,
        end_ns: int,
        routed: bool = True,
    ) -> str:
        """Emit the request's spans; returns its trace id (hex), or "" if not sampled.
        ``routed``: ``model`` is a served model (else the client's name for one, kept as an
        attribute but not in the span's name: span names stay a bounded set)."""
        trace = self._trace
        parent = None
        if t.traceparent:  # only a valid parent decides; a malformed one is as none
            parent = self.propagator.extract({"traceparent": t.traceparent})
            if not trace.get_current_span(parent).get_span_context().is_valid:
                parent = None
        if parent is None and (self.ratio <= 0.0 or random.random() >= self.ratio):
            return ""
        span = self.tracer.start_span(
            f"infer {model}" if routed else "infer",
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=self._at(t.received),
            attributes={"rtserve.model": model, "rtserve.version": version, "http.status": status},
        )
        if not span.is_recording():
            return ""
        ctx = trace.set_span_in_context(span)
        ready = t.done or end_ns
        first = t.enqueued or ready
        self._child("decode", ctx, t.received, first)
        if t.cache:
            self._child("cache", ctx, first, ready, {"rtserve.cache": t.cache})
        if t.batch_start:
            self._child("queue", ctx, t.enqueued, t.batch_start)
            batch = self._batch_span(model, version, t)
            links = [trace.Link(batch)] if batch is not None else None
            self._child(
                "compute",
                ctx,
                t.batch_start,
                t.batch_end,
                {"rtserve.batch_size": t.batch_size},
                links,
            )
        if t.prompt_tokens or t.completion_tokens:  # a generation: its tokens, named as
            span.set_attributes(  # OpenTelemetry's GenAI conventions name them
                {
                    "gen_ai.usage.input_tokens": t.prompt_tokens,
                    "gen_ai.usage.output_tokens": t.completion_tokens,
                }
            )
            self._child("generate", ctx, first, ready)
        self._child("encode", ctx, ready, end_ns)
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=self._at(end_ns))
        return format(span.get_span_context().trace_id, "032x")

    def _child(
        self,
        name: str,
        ctx: Any,
        start: int,
        end: int,
        attributes: dict[str, Any] | None = None,
        links: list[Any] | None = None,
    ) -> None:
        child = self.tracer.start_span(
            name, context=ctx, start_time=self._at(start), attributes=attributes, links=links
        )
        child.end(end_time=self._at(max(start, end)))

    def _batch_span(self, model: str, version: str, t: Timings) -> Any:
        """The span context of the request's batch (one span per batch, made once)."""
        key = (model, version, t.batch_start, t.batch_end)
        found = self._batches.get(key)
        if found is None:
            span = self.tracer.start_span(
                f"batch {model}",
                start_time=self._at(t.batch_start),
                attributes={"rtserve.model": model, "rtserve.batch_size": t.batch_size},
            )
            span.end(end_time=self._at(t.batch_end))
            found = self._batches[key] = span.get_span_context()
            if len(self._batches) > _MAX_BATCHES:
                self._batches.popitem(last=False)
        return found

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is buffered
