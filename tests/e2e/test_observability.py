"""Observability of the embedded stack: one trace per request, the TTFT breakdown, metrics and
the dashboard, all read from a real ``kvpush up --trace-file`` (gateway, P and D processes).

- One streamed HTTP request in mode push -> one trace id across the three services, with the
  spans of docs/observability.md, spans, and the parent links the bus and
  ``kv_transfer_params`` carry.
- Its breakdown (from the spans, as ``kvpush ttft`` computes it) adds up to the TTFT the HTTP
  client measured, within a few ms (the client's own connect/parse time).
- ``kvpush ttft FILE --json --png`` reports it; ``/metrics`` counts exactly the requests made.
- ``/dashboard`` in headless Chromium draws the requests' waterfalls (screenshot kept in
  ``test-output/``).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from PIL import Image

from kvpush.schemas.spans import SpanRecord
from kvpush.services import models
from kvpush.services.telemetry import spans as span_records
from kvpush.services.telemetry.breakdown import PART_NAMES, breakdowns_from_spans
from tests import browser
from tests.e2e.conftest import DECODE_ID, PREFILL_ID, UpStack

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 96  # six 16-token blocks
LAYERS = models.TINY.layers


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(PROMPT_TOKENS)]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, ids: list[int]
) -> tuple[str, int, int]:
    """(response id, unix ns before the request was sent, unix ns when its first SSE event was
    read): the client's view of TTFT, on the clock the spans use."""
    body = {
        "model": models.TINY.name,
        "prompt": ids,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "kvpush_mode": "push",
    }
    sent_ns = time.time_ns()
    first_event_ns = 0
    request_id = ""
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            first_event_ns = first_event_ns or time.time_ns()
            request_id = request_id or json.loads(line[6:])["id"]
    return request_id, sent_ns, first_event_ns


def trace_of(path: Path, request_id: str) -> list[SpanRecord]:
    records = list(span_records.read_jsonl(path)) if path.exists() else []
    roots = [
        r
        for r in records
        if r.name == "gateway.request" and r.attributes.get("kvpush.request_id") == request_id
    ]
    if not roots:
        return []
    return [r for r in records if r.trace_id == roots[0].trace_id]


EXPECTED = {  # (service, span) -> how many in one push request's trace
    ("kvpush-gateway", "gateway.request"): 1,
    ("kvpush-gateway", "gateway.render"): 1,
    ("kvpush-gateway", "gateway.route"): 1,
    ("kvpush-gateway", "bus.publish"): 1,
    ("kvpush-gateway", "gateway.first_byte"): 1,
    ("kvpush-prefill", "bus.receive"): 2,  # the RequestEvent, D's BlocksAnnounced
    ("kvpush-prefill", "prefill.queue"): 1,
    ("kvpush-prefill", "prefill.compute"): 1,
    ("kvpush-prefill", "kv.push"): 1,
    ("kvpush-prefill", "kv.push.done"): 1,
    ("kvpush-prefill", "bus.publish"): 1,  # KvPushed
    ("kvpush-decode", "bus.receive"): 3,  # the RequestEvent, P's FirstToken and KvPushed
    ("kvpush-decode", "decode.receive"): 1,
    ("kvpush-decode", "decode.allocate"): 1,
    ("kvpush-decode", "blocks.announce"): 1,
    ("kvpush-decode", "bus.publish"): 1,  # BlocksAnnounced
    ("kvpush-decode", "decode.wait_kv"): 1,
    ("kvpush-decode", "decode.first_token"): 1,
    ("kvpush-decode", "decode.first_chunk"): 1,
}


async def wait_for_trace(path: Path, request_id: str, timeout_s: float = 15.0) -> list[SpanRecord]:
    """The request's spans once every expected one was exported (batches: ~0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = trace_of(path, request_id)
        have = {(r.service, r.name) for r in found}
        if have >= set(EXPECTED) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)


async def test_one_request_is_one_trace_across_gateway_prefill_and_decode(
    up_stack: UpStack, rng: random.Random
) -> None:
    async with aiohttp.ClientSession() as session:
        await stream_completion(session, up_stack.url, prompt(rng))  # warm: handshake done
        request_id, sent_ns, first_event_ns = await stream_completion(
            session, up_stack.url, prompt(rng)
        )
    trace = await wait_for_trace(up_stack.trace_file, request_id)
    counts: dict[tuple[str, str], int] = {}
    for record in trace:
        key = (record.service, record.name)
        counts[key] = counts.get(key, 0) + 1
    assert {k: counts.get(k, 0) for k in EXPECTED} == EXPECTED, sorted(counts)

    by_id = {r.span_id: r for r in trace}
    assert len({r.trace_id for r in trace}) == 1

    def one(service: str, name: str, destination: str = "") -> SpanRecord:
        [found] = [
            r
            for r in trace
            if r.service == service
            and r.name == name
            and str(r.attributes.get("messaging.destination.name", "")).startswith(destination)
        ]
        return found

    def parent(record: SpanRecord) -> SpanRecord:
        assert record.parent_span_id in by_id, f"{record.name}: parent not in the trace"
        return by_id[record.parent_span_id]

    root = one("kvpush-gateway", "gateway.request")
    assert root.parent_span_id == "" and root.kind == "SERVER"
    assert root.attributes["kvpush.mode"] == "push"
    assert root.attributes["gen_ai.request.model"] == models.TINY.name
    assert root.attributes["gen_ai.usage.input_tokens"] == PROMPT_TOKENS
    assert root.attributes["kvpush.prefill_id"] == PREFILL_ID
    assert root.attributes["kvpush.decode_id"] == DECODE_ID
    for record in trace:
        if record is not root:
            parent(record)  # every parent link stays inside the trace
    publish = one("kvpush-gateway", "bus.publish", "kvpush.v1.req.")
    for name in ("gateway.render", "gateway.route", "bus.publish", "gateway.first_byte"):
        assert parent(one("kvpush-gateway", name)) is root
    render, route = one("kvpush-gateway", "gateway.render"), one("kvpush-gateway", "gateway.route")
    assert root.start_ns <= render.start_ns <= render.end_ns <= route.start_ns
    assert render.attributes["gen_ai.usage.input_tokens"] == PROMPT_TOKENS
    p_receive = one("kvpush-prefill", "bus.receive", "kvpush.v1.req.")
    d_receive = one("kvpush-decode", "bus.receive", "kvpush.v1.req.")
    assert parent(p_receive) is publish and parent(d_receive) is publish
    for name in ("prefill.queue", "prefill.compute", "kv.push", "kv.push.done"):
        assert parent(one("kvpush-prefill", name)) is p_receive, name
    for name in ("decode.receive", "decode.allocate", "blocks.announce", "decode.wait_kv"):
        assert parent(one("kvpush-decode", name)) is d_receive, name
    assert parent(one("kvpush-decode", "decode.first_token")) is d_receive
    assert parent(one("kvpush-decode", "decode.first_chunk")) is d_receive
    announce = one("kvpush-decode", "bus.publish", "kvpush.v1.blocks.")
    assert parent(announce) is d_receive
    assert parent(one("kvpush-prefill", "bus.receive", "kvpush.v1.blocks.")) is announce
    pushed = one("kvpush-prefill", "bus.publish", "kvpush.v1.kv.done.")
    done_subject = f"kvpush.v1.kv.done.{DECODE_ID}"
    kv_done = [
        r
        for r in trace
        if (r.service, r.name) == ("kvpush-decode", "bus.receive")
        and r.attributes.get("messaging.destination.name") == done_subject
    ]
    # P's KvPushed, and the first token its service sent on the request's own context
    assert sorted(parent(r).name for r in kv_done) == ["bus.publish", "bus.receive"], kv_done
    assert {parent(r).span_id for r in kv_done} == {pushed.span_id, p_receive.span_id}

    push = one("kvpush-prefill", "kv.push")
    assert [e.name for e in push.events] == ["layer"] * LAYERS
    assert sorted(e.attributes["layer"] for e in push.events) == list(range(LAYERS))
    assert push.attributes["kvpush.bytes"] > 0
    compute = one("kvpush-prefill", "prefill.compute")
    assert compute.start_ns <= compute.end_ns <= push.end_ns

    [found] = breakdowns_from_spans(trace)
    assert found.request_id == request_id and found.mode == "push"
    parts = dict(zip(PART_NAMES, found.parts_ms, strict=True))
    assert parts["prefill_compute"] > 0 and parts["decode_first_step"] > 0, parts
    first_byte = one("kvpush-gateway", "gateway.first_byte")
    gateway_ttft_ms = (first_byte.end_ns - root.start_ns) / 1e6
    assert sum(found.parts_ms) == pytest.approx(gateway_ttft_ms, abs=1e-3)
    # The gateway's TTFT lies inside the client's (one host, one clock), ordered by causality
    # only: the client sent before the gateway's root span began, and D's first token came
    # before both the gateway's first byte and the client's first event. The gateway's first
    # byte and the client's first event are not ordered: the gateway takes its instant when its
    # write returns, and the client may already have read the bytes by then.
    d_first_token = one("kvpush-decode", "decode.first_token")
    assert sent_ns <= root.start_ns < d_first_token.end_ns <= first_byte.end_ns
    # D hands its first chunk to the bus after it received the request, before the gateway
    # takes the chunk (instants of one clock, each before the next by causality)
    first_chunk = one("kvpush-decode", "decode.first_chunk")
    assert d_receive.start_ns <= first_chunk.end_ns <= first_byte.end_ns
    assert d_first_token.end_ns <= first_event_ns


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text ``text`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if match and match.group(1) == name:
            got = ",".join(sorted((match.group(2) or "").split(","))) if match.group(2) else ""
            if got == want:
                return float(match.group(3))
    return 0.0


async def test_metrics_ttft_report_and_dashboard_cover_the_requests_made(
    up_stack: UpStack, rng: random.Random, tmp_path: Path
) -> None:
    n = 3
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{up_stack.url}/metrics") as resp:
            before = await resp.text()
        ids = [(await stream_completion(session, up_stack.url, prompt(rng)))[0] for _ in range(n)]
        await asyncio.sleep(0.2)  # KvPushed reaches the gateway's observer
        async with session.get(f"{up_stack.url}/metrics") as resp:
            after = await resp.text()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvpush_gateway_time_to_first_token_seconds_count", mode="push") == n
    assert delta("kvpush_gateway_time_per_output_token_seconds_count", mode="push") == n
    assert delta("kvpush_gateway_request_duration_seconds_count", mode="push") == n
    for part in PART_NAMES:
        assert delta("kvpush_gateway_ttft_part_seconds_count", part=part) == n, part
    assert delta("kvpush_kv_transfers_total", outcome="done") == n
    assert delta("kvpush_kv_transfer_seconds_count", mode="push") == n
    assert delta("kvpush_kv_transfer_bytes_total", mode="push") > 0
    assert delta("kvpush_gateway_kv_outcomes_total", mode="push", outcome="received") == n
    for worker, role in ((PREFILL_ID, "prefill"), (DECODE_ID, "decode")):
        total = metric(after, "kvpush_worker_total_blocks", worker=worker, role=role)
        free = metric(after, "kvpush_worker_free_blocks", worker=worker, role=role)
        assert total > 0 and 0 < free <= total, (worker, total, free)

    # kvpush ttft on the stack's trace file: every request made so far, with its parts.
    for request_id in ids:
        await wait_for_trace(up_stack.trace_file, request_id)
    report, png = tmp_path / "ttft.json", tmp_path / "waterfall.png"
    cli = [sys.executable, "-m", "kvpush.services.cli", "ttft"]
    done = subprocess.run(
        [*cli, str(up_stack.trace_file), "--json", str(report), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "p99" in done.stdout
    reported = json.loads(report.read_text())
    rows = {r["request_id"]: r for r in reported["requests"]}
    for request_id in ids:
        parts = rows[request_id]["parts_ms"]
        assert set(parts) == set(PART_NAMES) and parts["prefill_compute"] > 0
        assert sum(parts.values()) == pytest.approx(rows[request_id]["ttft_ms"], abs=0.01)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width >= 800

    # The gateway's dashboard draws them, in a real browser.
    page = f"{up_stack.url}/dashboard"
    dom = browser.parse(await asyncio.to_thread(browser.dump_dom, page, 3000))
    drawn = {r.attrs["data-request-id"]: r for r in dom.find_all(cls="waterfall-row")}
    for request_id in ids:
        row = drawn[request_id]
        parts = {s.attrs["data-part"]: s for s in row.find_all(cls="segment")}
        assert float(parts["prefill_compute"].style()["width"].rstrip("%")) > 0
    shot = await asyncio.to_thread(browser.screenshot, page, tmp_path / "dashboard.png")
    kept = browser.output_dir() / "dashboard-e2e.png"
    shutil.copyfile(shot, kept)
    print(f"dashboard screenshot: {kept}")


def total(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (any labels) in the Prometheus text ``text``."""
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


async def test_each_worker_serves_vllm_s_engine_metrics(
    up_stack: UpStack, rng: random.Random
) -> None:
    """vLLM's ``vllm:*`` series of each engine reach Prometheus from the worker's own
    ``/metrics`` (``--metrics-port``; ``kvpush up`` gives each worker one and prints it)."""
    urls = dict(
        re.findall(
            r"(\S+) (http://\S+/metrics)", up_stack.output().split("(vllm:*): ")[1].splitlines()[0]
        )
    )
    assert set(urls) == {PREFILL_ID, DECODE_ID}, urls

    async def scrape() -> dict[str, str]:
        async with aiohttp.ClientSession() as session:
            return {w: await (await session.get(url)).text() for w, url in urls.items()}

    before = await scrape()
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            await stream_completion(session, up_stack.url, prompt(rng))
    after = await scrape()
    for worker in (PREFILL_ID, DECODE_ID):
        done = total(after[worker], "vllm:request_success_total")
        assert done >= total(before[worker], "vllm:request_success_total") + 2, worker
        assert total(after[worker], "vllm:prompt_tokens_total") > 0, worker
        assert "vllm:kv_cache_usage_perc" in after[worker], worker
