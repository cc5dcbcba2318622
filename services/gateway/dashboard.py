"""The gateway's ``/dashboard``: live counters and a TTFT waterfall of recent requests.

This module owns the recent-requests window (``RecentRequests``, a bounded ring of finished
generation requests with their TTFT ``Breakdown``) and two routes (``add_routes``):

- ``GET /dashboard``: one self-contained HTML page (``static/dashboard.html``: inline CSS and
  JS, nothing from another host; a Content-Security-Policy with the hashes of its inline
  script and style lets it load nothing else). It polls ``/dashboard/data`` every second and
  draws the counters as tiles, a legend of the parts and one waterfall row per request:
  consecutive segments, one per non-zero part, on a scale shared by all rows; a row's mode
  shows its routing decision on hover (reason, candidate, estimated TTFT, prefix held).
- ``GET /dashboard/data``: ``{"parts": [[name, label, color], ...], "counters": {...},
  "requests": [...], "ring": {"instance", "capacity"}}`` (requests newest first, each with a
  ``seq`` counted from 1 in this process; ``instance``: a token new at each gateway start, so a
  reader that kept a ``seq`` can tell a restart), ``Cache-Control: no-store``.

Threading model: everything runs on the gateway's event loop; ``RecentRequests`` is not
thread-safe (``add`` and ``snapshot`` are called from that loop only).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import math
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from kvpush.services.gateway.route_choice import RouteNote
from kvpush.services.telemetry.breakdown import PART_NAMES, Breakdown

# Display label and color of each part (Okabe-Ito palette: tells apart with color blindness).
PART_STYLE: Final[dict[str, tuple[str, str]]] = {
    "gateway": ("Gateway", "#CC79A7"),
    "queue_prefill": ("Prefill queue", "#E69F00"),
    "prefill_compute": ("Prefill compute", "#0072B2"),
    "push_tail": ("KV push tail", "#D55E00"),
    "decode_wait": ("Decode wait", "#56B4E9"),
    "decode_first_step": ("Decode first step", "#009E73"),
    "streaming": ("Streaming", "#8C6D1F"),
}
PARTS: Final[list[list[str]]] = [[name, *PART_STYLE[name]] for name in PART_NAMES]
DEFAULT_CAPACITY: Final = 200
NO_ROUTE: Final = RouteNote(reason="", decode_id="")  # a row's route keys without a decision


class RecentRequests:
    """The last ``capacity`` finished requests, as JSON-ready rows (see the module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.instance = secrets.token_hex(8)  # this ring's, new at each gateway start
        self._rows: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(
        self,
        breakdown: Breakdown | None,
        *,
        request_id: str,
        mode: str,
        status: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_ms: float | None,
        e2e_ms: float,
        kv: str = "",
        route: RouteNote | None = None,
    ) -> None:
        """Record one finished request. ``breakdown`` is None when the request failed before
        its first byte or its parts are unknown (drawn as a grey row with ``status``);
        ``ttft_ms`` None falls back to the breakdown's sum. ``kv``: what decode did with a
        served push/pull request (``received`` or ``fallback``; empty otherwise). ``route``: its
        routing decision (``RouteNote.row``'s keys: ``route_reason``, ``route_choice``,
        ``estimate_ms``, ``prefix_tokens``, ``decode_id``, ``prefill_id``; there, empty,
        without one)."""
        if ttft_ms is None and breakdown is not None:
            ttft_ms = breakdown.ttft_ms
        parts = None
        if breakdown is not None:
            parts = {n: round(v, 3) for n, v in zip(PART_NAMES, breakdown.parts_ms, strict=True)}
        self._seq += 1
        self._rows.append(
            {
                "seq": self._seq,
                "request_id": request_id,
                "trace_id": breakdown.trace_id if breakdown is not None else "",
                "mode": mode,
                "status": status,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
                "e2e_ms": round(e2e_ms, 3),
                "kv": kv,
                "finished_at_ms": int(time.time() * 1000),
                "parts_ms": parts,
                **(route or NO_ROUTE).row(),
            }
        )

    def snapshot(self) -> list[dict[str, Any]]:
        """The rows, newest first (fresh dicts: callers may keep or change them)."""
        return [
            {**row, "parts_ms": dict(row["parts_ms"]) if row["parts_ms"] else None}
            for row in reversed(self._rows)
        ]

    def ttft_quantiles(self, *quantiles: float) -> dict[float, float | None]:
        """Nearest-rank TTFT quantiles (ms) of the window's requests that had a first byte;
        None while there are none. E.g. ``ttft_quantiles(0.5, 0.99)`` for counter tiles."""
        values = sorted(r["ttft_ms"] for r in self._rows if r["ttft_ms"] is not None)
        result: dict[float, float | None] = {}
        for q in quantiles:
            result[q] = values[min(len(values) - 1, int(q * len(values)))] if values else None
        return result


def _finite(value: float | None) -> float | None:
    """NaN and infinities as null (JSON has neither; the page shows a dash)."""
    return value if value is None or math.isfinite(value) else None


def _page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (hashes of its inline blocks)."""
    text = (
        importlib.resources.files("kvpush.services.gateway")
        .joinpath("static/dashboard.html")
        .read_text(encoding="utf-8")
    )

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
        digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
        return " ".join(f"'sha256-{d}'" for d in digests)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return text.encode("utf-8"), csp


def add_routes(
    app: web.Application, recent: RecentRequests, counters: Callable[[], dict[str, float]]
) -> None:
    """``GET /dashboard`` and ``GET /dashboard/data``; ``counters()`` is called once per poll
    (every second per open page) and its keys become the tiles' labels (``_`` shown as space)."""
    body, csp = _page()

    async def page(request: web.Request) -> web.Response:
        return web.Response(
            body=body,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": csp,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
            },
        )

    async def data(request: web.Request) -> web.Response:
        tiles = {str(k): _finite(v) for k, v in counters().items()}
        payload = {
            "parts": PARTS,
            "counters": tiles,
            "requests": recent.snapshot(),
            "ring": {"instance": recent.instance, "capacity": recent.capacity},
        }
        return web.json_response(payload, headers={"Cache-Control": "no-store"})

    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/data", data)
