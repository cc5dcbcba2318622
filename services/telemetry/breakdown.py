"""The TTFT breakdown: where each millisecond between arrival and first byte went.

One function turns a request's ``Timing`` (critical-path instants, unix ns) into consecutive
parts that add up exactly to its TTFT as the gateway saw it (arrival to the first byte
written). Each boundary is clamped to be no earlier than the one before, and a missing instant
(0) collapses its part to zero, so the parts always telescope to ``first_byte - arrived``:

==================  =========================================================================
part                from -> to
==================  =========================================================================
gateway             arrived -> published (parse, tokenize, route, publish the RequestEvent)
queue_prefill       published -> prefill_start (bus to P, P's engine queue)
prefill_compute     prefill_start -> prefill_end (P's forward of the prompt)
push_tail           prefill_end -> kv_sent (transfer time not hidden behind compute; pull:
                    D's READ)
decode_wait         kv_sent -> kv_landed (D learns the KV is there)
decode_first_step   kv_landed -> first_token (D's first engine step; with P's first token: D
                    taking it up and reporting it, no model step; mode local: D's prefill)
streaming           first_token -> first_byte (token chunk over the bus, gateway writes it)
==================  =========================================================================

Two sources feed it: spans (``timing_from_spans``, used by ``kvpush ttft``) and the ``timing``
fields carried on the bus (KvPushed / KvReady / last TokenChunk, used by the gateway for
``/dashboard`` and the ``kvpush_gateway_ttft_part_seconds`` histogram).

Threading model: pure functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Final

import msgspec

from kvpush.schemas.messages import Timing
from kvpush.schemas.spans import SpanRecord

# (part name, the Timing field that ends it), in path order; the first part starts at arrived.
PARTS: Final = (
    ("gateway", "published"),
    ("queue_prefill", "prefill_start"),
    ("prefill_compute", "prefill_end"),
    ("push_tail", "kv_sent"),
    ("decode_wait", "kv_landed"),
    ("decode_first_step", "first_token"),
    ("streaming", "first_byte"),
)
PART_NAMES: Final = tuple(name for name, _ in PARTS)

# Span name -> (Timing field, "start" or "end"). The publish of the RequestEvent is the
# ``bus.publish`` child of ``gateway.request`` (see ``timing_from_spans``).
SPAN_MARKS: Final = {
    "gateway.request": (("arrived", "start"),),
    "prefill.queue": (("prefill_received", "start"),),
    "prefill.compute": (("prefill_start", "start"), ("prefill_end", "end")),
    "kv.push": (("kv_sent", "end"),),
    "kv.pull": (("kv_sent", "end"),),
    "decode.allocate": (("decode_received", "start"),),
    "decode.wait_kv": (("kv_landed", "end"),),
    "decode.first_token": (("first_token", "end"),),
    "gateway.first_byte": (("first_byte", "end"),),
}


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A request's TTFT split into ``PART_NAMES`` (milliseconds, same order)."""

    trace_id: str
    request_id: str
    mode: str
    start_ns: int  # arrived
    parts_ms: tuple[float, ...]

    @property
    def ttft_ms(self) -> float:
        return sum(self.parts_ms)

    def as_dict(self) -> dict[str, object]:
        return {
            "trace_id": self.trace_id,
            "request_id": self.request_id,
            "mode": self.mode,
            "start_ns": self.start_ns,
            "ttft_ms": round(self.ttft_ms, 3),
            "parts_ms": {n: round(v, 3) for n, v in zip(PART_NAMES, self.parts_ms, strict=True)},
        }


def merge(*timings: Timing | None) -> Timing:
    """Field-wise merge: the first non-zero value of each field wins."""
    values: dict[str, int] = {}
    for timing in timings:
        if timing is None:
            continue
        for field in Timing.__struct_fields__:
            if not values.get(field):
                values[field] = getattr(timing, field)
    return Timing(**values)


def breakdown(
    timing: Timing, *, trace_id: str = "", request_id: str = "", mode: str = ""
) -> Breakdown | None:
    """The parts of ``timing``; None without both ``arrived`` and ``first_byte``."""
    if not timing.arrived or not timing.first_byte or timing.first_byte < timing.arrived:
        return None
    end = timing.first_byte
    previous = timing.arrived
    parts: list[float] = []
    for _, field in PARTS:
        mark = getattr(timing, field) or previous
        boundary = min(max(previous, mark), end)
        parts.append((boundary - previous) / 1e6)
        previous = boundary
    return Breakdown(trace_id, request_id, mode, timing.arrived, tuple(parts))


def timing_from_spans(spans: Iterable[SpanRecord]) -> Timing:
    """The ``Timing`` of one trace's spans (all of one request)."""
    spans = list(spans)
    values: dict[str, int] = {}
    roots = {s.span_id for s in spans if s.name == "gateway.request"}
    for span in spans:
        for field, edge in SPAN_MARKS.get(span.name, ()):
            stamp = span.start_ns if edge == "start" else span.end_ns
            if stamp and not values.get(field):
                values[field] = stamp
        destination = str(span.attributes.get("messaging.destination.name", ""))
        if (
            span.name == "bus.publish"
            and span.parent_span_id in roots
            and destination.startswith("kvpush.v1.req.")
        ):
            values["published"] = span.end_ns
    return msgspec.convert(values, Timing)


def breakdowns_from_spans(spans: Iterable[SpanRecord]) -> list[Breakdown]:
    """One ``Breakdown`` per trace that has a ``gateway.request`` root and a first byte,
    ordered by arrival."""
    by_trace: dict[str, list[SpanRecord]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    result: list[Breakdown] = []
    for trace_id, trace_spans in by_trace.items():
        root = next((s for s in trace_spans if s.name == "gateway.request"), None)
        if root is None:
            continue
        found = breakdown(
            timing_from_spans(trace_spans),
            trace_id=trace_id,
            request_id=str(root.attributes.get("kvpush.request_id", "")),
            mode=str(root.attributes.get("kvpush.mode", "")),
        )
        if found is not None:
            result.append(found)
    result.sort(key=lambda b: b.start_ns)
    return result
