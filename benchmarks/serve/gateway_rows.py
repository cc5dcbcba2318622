"""What the kvpush gateway says of a benchmark point's requests: TTFT breakdown and routing.

Every kvpush system (``KvpushSystem``, whatever its transfer check) is fronted by a gateway whose
``/dashboard/data`` keeps a ring of its last finished requests, newest first: ``requests`` (each
row with a ``seq`` counted from 1 by each gateway process) and ``ring`` (``instance``, new at
each gateway start, and ``capacity``: 200). The bench reads it around each point:

- ``ring_mark`` before the point: the ring's instance and newest ``seq``;
- ``ours_of`` tells the point's rows: with vLLM's client (whose ``prefix_repetition`` dataset
  drops ``--request-id-prefix``, so the ids cannot tell; the point is the only traffic then)
  those added after the mark, or every row of a gateway that restarted since; with kvpush's
  client the ids it answered;
- ``point_rows`` reads them once they are there (the gateway adds a row right after a request's
  last chunk: it waits up to ``SETTLE_S`` for the rows expected);
- ``point_extras`` makes the two pure summaries the ``Point`` keeps, ``breakdown_of`` (P50/P99/
  mean of each TTFT part) and ``routing_of`` (per ``mode/route_reason`` the count, the TTFT P50
  of those served OK, the cost model's estimate P50 and D's prefix hit P50; the count per
  decode worker). Both say how many rows they read (``requests``); when the ring could not
  hold the whole point (more requests than its capacity, or a gateway that restarted
  mid-point), ``of`` says how many the point completed, and the reports show "N of M" rather
  than a part passed off as the whole.

A key an older gateway does not send is taken as absent (no ``ring``: instance "", so rows are
told by ``seq`` alone, as before).

Threading model: asyncio on the bench's loop (one short HTTP GET per read); the ``*_of``
functions are pure.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import msgspec
import numpy as np

from kvpush.benchmarks.serve.checks import SETTLE_S, http_get
from kvpush.benchmarks.serve.loadgen import RequestResult
from kvpush.services.gateway.dashboard import DEFAULT_CAPACITY as RING
from kvpush.services.telemetry.breakdown import PART_NAMES

ABSENT = "-"  # a mode or route reason the row does not name (an older gateway, no decision)

Ours = Callable[[str, dict[str, Any]], bool]
"""Is this row (second argument), read from the ring of this gateway instance (first), one of
the point's?"""


class RingMark(msgspec.Struct, frozen=True):
    """Where the gateway's ring stood: its ``instance`` ("" from an older gateway) and the
    ``seq`` of its newest row (0: none yet)."""

    instance: str
    seq: int


class RingPage(msgspec.Struct, frozen=True):
    """One read of ``/dashboard/data``: the ring's instance and its rows, newest first."""

    instance: str
    rows: list[dict[str, Any]]

    @property
    def mark(self) -> RingMark:
        newest = max((int(r.get("seq") or 0) for r in self.rows), default=0)
        return RingMark(self.instance, newest)


def ours_of(client: str, after: RingMark | None, results: list[RequestResult]) -> Ours:
    """Which gateway rows are this point's (see the module docstring). ``after``: the mark read
    before the point (None: unread, so with vLLM's client no row can be told ours)."""
    if client == "vllm":
        if after is None:
            return lambda _instance, _row: False
        return lambda instance, row: (
            instance != after.instance or int(row.get("seq") or 0) > after.seq
        )
    answered = {r.request_id for r in results if r.request_id}
    return lambda _instance, row: str(row.get("request_id") or "") in answered


async def read_ring(url: str) -> RingPage | None:
    """The gateway's ``/dashboard/data`` ring; None when it cannot be read."""
    try:
        status, text = await http_get(f"{url}/dashboard/data")
        data = json.loads(text) if status == 200 else None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None
    rows = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        return None
    ring = data.get("ring") if isinstance(data.get("ring"), dict) else {}
    instance = str(ring.get("instance") or "")
    return RingPage(instance, [r for r in rows if isinstance(r, dict)])


async def ring_mark(url: str) -> RingMark | None:
    """Where the ring stands now; None when the page cannot be read."""
    page = await read_ring(url)
    return None if page is None else page.mark


async def point_rows(url: str, ours: Ours, expected: int = 0) -> list[dict[str, Any]] | None:
    """This point's rows (``ours``: ``ours_of``); None when the page cannot be read. Waits up to
    ``SETTLE_S`` for ``expected`` rows (at most the ring's capacity)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        page = await read_ring(url)
        if page is None:
            return None
        found = [r for r in page.rows if ours(page.instance, r)]
        if len(found) >= min(expected, RING) or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(0.05)


def breakdown_of(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """P50/P99/mean per TTFT part of the rows that have their parts; None without any."""
    parts = [r["parts_ms"] for r in rows if r.get("parts_ms")]
    if not parts:
        return None
    result: dict[str, Any] = {"requests": len(parts)}
    for name in PART_NAMES:
        values = np.asarray([p[name] for p in parts])
        result[name] = {
            "mean": round(float(values.mean()), 3),
            "p50": round(float(np.percentile(values, 50)), 3),
            "p99": round(float(np.percentile(values, 99)), 3),
        }
    return result


def _p50(values: Iterable[Any]) -> float | None:
    found = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return round(statistics.median(found), 3) if found else None


def _decode_hit(row: dict[str, Any]) -> Any:
    held = row.get("prefix_tokens")
    return held[1] if isinstance(held, list | tuple) and len(held) == 2 else None


def routing_of(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the gateway routed the rows; None without rows. Keys sorted, floats to 3 decimals:
    ``{"decode": {decode_id: count}, "groups": {"<mode>/<route_reason>": {"count",
    "decode_prefix_p50" (tokens), "estimate_p50_ms" and "ttft_p50_ms" (both of those served OK)}},
    "requests"}`` (a P50 without a value: null; a row without a decode worker: not counted)."""
    if not rows:
        return None
    grouped: dict[str, list[dict[str, Any]]] = {}
    decode: dict[str, int] = {}
    for row in rows:
        key = f"{row.get('mode') or ABSENT}/{row.get('route_reason') or ABSENT}"
        grouped.setdefault(key, []).append(row)
        if row.get("decode_id"):
            decode[str(row["decode_id"])] = decode.get(str(row["decode_id"]), 0) + 1
    groups = {
        key: {
            "count": len(members),
            "decode_prefix_p50": _p50(_decode_hit(r) for r in members),
            "estimate_p50_ms": _p50(
                r.get("estimate_ms") for r in members if r.get("status") == "ok"
            ),
            "ttft_p50_ms": _p50(r.get("ttft_ms") for r in members if r.get("status") == "ok"),
        }
        for key, members in sorted(grouped.items())
    }
    return {"decode": dict(sorted(decode.items())), "groups": groups, "requests": len(rows)}


async def point_extras(url: str, ours: Ours, expected: int) -> dict[str, Any]:
    """A kvpush point's ``breakdown`` and ``routing`` (both None when the rows are unread);
    each with ``of``: ``expected`` when it read fewer rows than that."""
    rows = await point_rows(url, ours, expected) or []
    extras = {"breakdown": breakdown_of(rows), "routing": routing_of(rows)}
    for summary in extras.values():
        if summary is not None and summary["requests"] < expected:
            summary["of"] = expected
    return extras
