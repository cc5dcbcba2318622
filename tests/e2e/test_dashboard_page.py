"""``/dashboard`` on a standalone aiohttp app: the recent-requests ring, the data JSON, a page
that loads nothing from elsewhere, and what headless Chromium draws from synthetic breakdowns
(one waterfall row per request, segments proportional on one scale, untrusted text as text).
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvpush.services.gateway.dashboard import PARTS, RecentRequests, add_routes
from kvpush.services.gateway.route_choice import RouteNote
from kvpush.services.telemetry.breakdown import PART_NAMES, Breakdown
from tests import browser

HOSTILE_ID = '<script>document.title="pwned"</script><b>x</b>'
FAILED_ID = "cmpl-failedbeforefirstbyte"
# request id -> (mode, parts in PART_NAMES order); zeros must draw no segment
SYNTHETIC: dict[str, tuple[str, tuple[float, ...]]] = {
    "cmpl-00000000000000000000000000000001": ("push", (1.5, 3.0, 42.0, 2.5, 0.4, 11.0, 0.6)),
    "cmpl-00000000000000000000000000000002": ("push", (2.0, 1.0, 61.0, 0.0, 0.3, 12.5, 0.7)),
    "cmpl-00000000000000000000000000000003": ("pull", (1.2, 2.2, 38.0, 9.5, 0.5, 10.0, 0.5)),
    HOSTILE_ID: ("local", (0.9, 0.0, 0.0, 0.0, 0.0, 24.0, 0.4)),
}
COUNTERS = {"requests_in_flight": 1.0, "requests_served": 42.0, "ttft_p50_ms": 57.75}
# the routing decision of the first push row (its mode's hover text)
ROUTED_ID = "cmpl-00000000000000000000000000000001"
ROUTE = RouteNote("cost", "d1", "p0", "push p0>d1", 58.25, (0, 256))


def make_recent() -> RecentRequests:
    recent = RecentRequests()
    recent.add(
        None,
        request_id=FAILED_ID,
        mode="push",
        status="no_worker",
        prompt_tokens=12,
        completion_tokens=0,
        ttft_ms=None,
        e2e_ms=2.5,
    )
    for request_id, (mode, parts) in SYNTHETIC.items():
        recent.add(
            Breakdown("t" + request_id[-4:], request_id, mode, 1, parts),
            request_id=request_id,
            mode=mode,
            status="length",
            prompt_tokens=300,
            completion_tokens=8,
            ttft_ms=None,
            e2e_ms=sum(parts) + 40.0,
            route=ROUTE if request_id == ROUTED_ID else None,
        )
    return recent


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, RecentRequests]]:
    """The dashboard on 127.0.0.1:<free port>; yields its base URL and the ring."""
    recent = make_recent()
    app = web.Application()
    add_routes(app, recent, lambda: dict(COUNTERS))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", recent
    await runner.cleanup()


def test_the_ring_keeps_the_newest_first_and_forgets_the_oldest() -> None:
    recent = RecentRequests(capacity=3)
    for i in range(5):
        parts = (1.0, 0.0, float(i), 0.0, 0.0, 2.0, 0.0)
        breakdown = Breakdown("t", f"r{i}", "push", 1, parts) if i != 3 else None
        recent.add(
            breakdown,
            request_id=f"r{i}",
            mode="push",
            status="ok" if breakdown else "timeout",
            prompt_tokens=i,
            completion_tokens=1,
            ttft_ms=None,
            e2e_ms=10.0,
        )
    rows = recent.snapshot()
    assert [r["request_id"] for r in rows] == ["r4", "r3", "r2"] and len(recent) == 3
    assert [r["seq"] for r in rows] == [5, 4, 3]
    assert rows[0]["ttft_ms"] == 7.0  # the breakdown's sum when ttft_ms is None
    assert rows[0]["parts_ms"] == dict(
        zip(PART_NAMES, (1.0, 0.0, 4.0, 0.0, 0.0, 2.0, 0.0), strict=True)
    )
    assert rows[1]["parts_ms"] is None and rows[1]["ttft_ms"] is None
    assert rows[1]["status"] == "timeout"
    rows[0]["parts_ms"]["gateway"] = 99.0  # a snapshot is the caller's own
    assert recent.snapshot()[0]["parts_ms"]["gateway"] == 1.0
    assert recent.ttft_quantiles(0.0, 0.5, 1.0) == {0.0: 5.0, 0.5: 7.0, 1.0: 7.0}
    assert RecentRequests().ttft_quantiles(0.5) == {0.5: None}
    with pytest.raises(ValueError):
        RecentRequests(0)


async def test_data_is_json_of_parts_counters_and_requests_newest_first(
    served: tuple[str, RecentRequests],
) -> None:
    url, recent = served
    async with aiohttp.ClientSession() as session, session.get(f"{url}/dashboard/data") as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        assert resp.headers["Cache-Control"] == "no-store"
        data = await resp.json()
    assert set(data) == {"parts", "counters", "requests", "ring"}
    assert data["ring"] == {"instance": recent.instance, "capacity": 200}
    assert re.fullmatch(r"[0-9a-f]{16}", recent.instance)
    assert RecentRequests().instance != recent.instance  # a new gateway: a new ring
    assert [p[0] for p in data["parts"]] == list(PART_NAMES) and data["parts"] == PARTS
    assert all(re.fullmatch(r"#[0-9A-Fa-f]{6}", color) for _, _, color in data["parts"])
    assert data["counters"] == COUNTERS
    assert data["requests"] == recent.snapshot()
    ids = [r["request_id"] for r in data["requests"]]
    assert ids == [*reversed(SYNTHETIC), FAILED_ID]
    first = data["requests"][0]
    assert first["mode"] == "local" and first["prompt_tokens"] == 300
    assert first["ttft_ms"] == pytest.approx(25.3)
    assert data["requests"][-1]["parts_ms"] is None
    routed = data["requests"][-2]
    assert routed["request_id"] == ROUTED_ID and routed["route_choice"] == "push p0>d1"
    assert routed["estimate_ms"] == 58.25 and routed["prefix_tokens"] == [0, 256]
    assert first["route_reason"] == "" and first["estimate_ms"] is None


async def test_a_non_finite_counter_is_sent_as_null() -> None:
    app = web.Application()
    add_routes(app, RecentRequests(), lambda: {"ttft_p99_ms": float("nan")})
    request = make_mocked_request("GET", "/dashboard/data", app=app)
    match = await app.router.resolve(request)
    response: Any = await match.handler(request)
    assert response.text.count("null") == 1 and "NaN" not in response.text


async def test_the_page_is_self_contained(served: tuple[str, RecentRequests]) -> None:
    url, _ = served
    async with aiohttp.ClientSession() as session, session.get(f"{url}/dashboard") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
        csp = resp.headers["Content-Security-Policy"]
    assert not re.findall(r"(?i)(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page)  # no other host
    assert not re.search(r"(?i)<link|<img|<iframe|@import|url\(|\bsrc\s*=", page)
    assert page.count("<script>") == 1 and page.count("<style>") == 1
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "'unsafe-inline'" not in csp and csp.count("'sha256-") == 2
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page


async def test_chromium_draws_one_waterfall_row_per_request_on_one_scale(
    served: tuple[str, RecentRequests], tmp_path: Path
) -> None:
    url, _ = served
    # blocking calls on a thread: the server answers the page's fetches on this loop
    dom = browser.parse(await asyncio.to_thread(browser.dump_dom, f"{url}/dashboard", 3000))
    rows = dom.find_all(cls="waterfall-row")
    assert [r.attrs["data-request-id"] for r in rows] == [*reversed(SYNTHETIC), FAILED_ID]

    scale = max(sum(parts) for _, parts in SYNTHETIC.values())
    for row in rows[:-1]:
        request_id = row.attrs["data-request-id"]
        mode, parts = SYNTHETIC[request_id]
        assert "failed" not in row.classes and mode in row.text
        segments = row.find_all(cls="segment")
        nonzero = [(n, v) for n, v in zip(PART_NAMES, parts, strict=True) if v > 0]
        assert [s.attrs["data-part"] for s in segments] == [n for n, _ in nonzero]
        for segment, (name, ms) in zip(segments, nonzero, strict=True):
            width = segment.style()["width"]
            assert width.endswith("%")
            assert float(width[:-1]) == pytest.approx(ms / scale * 100, abs=1e-3), name
            assert segment.attrs["title"].endswith(" ms") and segment.attrs["title"] != ""
        assert sum(float(s.style()["width"][:-1]) for s in segments) <= 100.0 + 1e-3
    assert rows[1].find_all(cls="segment")[2].attrs["title"] == "Prefill compute: 38.0 ms"
    [routed] = [r for r in rows if r.attrs["data-request-id"] == ROUTED_ID]
    route_title = routed.find_all(cls="mode")[0].attrs["title"]
    assert route_title == (
        "push (cost) · push p0>d1 · estimated TTFT 58.3 ms · prefix held: P 0, D 256 tokens"
    )

    failed = rows[-1]
    assert "failed" in failed.classes and not failed.find_all(cls="segment")
    assert "no_worker" in failed.text

    # the hostile id is text and attribute values only: no element of its making
    assert len(dom.find_all("script")) == 1 and not dom.find_all("b")
    [hostile] = [r for r in rows if r.attrs["data-request-id"] == HOSTILE_ID]
    assert hostile.find_all(cls="rid")[0].attrs["title"] == HOSTILE_ID
    assert dom.find_all("title")[0].text == "kvpush · gateway dashboard"

    tiles = {t.attrs["data-counter"]: t.text for t in dom.find_all(cls="tile")}
    assert tiles == {
        "requests_in_flight": "Requests in flight1",
        "requests_served": "Requests served42",
        "ttft_p50_ms": "TTFT p50 ms57.8",
    }
    legend = [li.attrs["data-part"] for li in dom.find_all("li")]
    assert legend == list(PART_NAMES)
    [status] = [e for e in dom.iter() if e.attrs.get("id") == "status"]
    assert status.text.startswith("live")

    shot = await asyncio.to_thread(browser.screenshot, f"{url}/dashboard", tmp_path / "d.png")
    kept = browser.output_dir() / "dashboard.png"
    shutil.copyfile(shot, kept)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"dashboard screenshot: {kept} (and {shot})")
