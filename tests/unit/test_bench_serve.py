"""The serving benchmark's load generator and report, against a scripted SSE server.

The server answers ``/v1/completions`` like vLLM's OpenAI server (one SSE chunk per token, a
usage chunk, ``[DONE]``) after known delays, so the measured TTFT / ITL / TPOT and the error
counts are checked against what was scripted. The report is checked on the resulting document.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from kvpush.services.bench.serve import loadgen, report

FIRST_DELAY_S = 0.05
GAP_S = 0.01


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"][0] == 13:  # the scripted failure
        return web.json_response({"error": {"message": "boom"}}, status=500)
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_DELAY_S)
    n = body["max_tokens"]
    for i in range(n):
        if i:
            await asyncio.sleep(GAP_S)
        chunk = {"id": f"cmpl-{body['prompt'][1]}", "choices": [{"text": f"t{i}"}]}
        if i == n - 1:
            chunk["choices"][0]["finish_reason"] = "length"
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage = {"id": "x", "choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 4}}
    await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_a_concurrency_point_measures_what_the_server_scripted(server: str) -> None:
    point = loadgen.LoadPoint("random", 4, 6, concurrency=2, output_len=5)
    prompts = [[10 + (i == 3) * 3, i, 0, 0] for i in range(6)]  # request 3 fails (token 13)
    done: list[int] = []
    results, wall = await loadgen.run_point(
        server, "m", point, prompts, progress=lambda: done.append(1)
    )
    assert len(done) == 6
    summary = loadgen.summarize(results, wall)
    assert summary["completed"] == 5 and summary["errors"] == 1
    assert summary["error_samples"][0].startswith("HTTP 500")
    ok = [r for r in results if r.error is None]
    assert [r.request_id for r in ok] == [f"cmpl-{i}" for i in (0, 1, 2, 4, 5)]
    for r in ok:
        assert r.output_tokens == 5 and len(r.itl_s) == 4
        assert FIRST_DELAY_S <= r.ttft_s < FIRST_DELAY_S + 0.5
        assert all(GAP_S * 0.9 <= gap < GAP_S + 0.3 for gap in r.itl_s)
        assert r.e2e_s >= r.ttft_s + 4 * GAP_S * 0.9
    assert summary["ttft_ms"]["p50"] >= FIRST_DELAY_S * 1e3
    assert summary["tpot_ms"]["mean"] >= GAP_S * 1e3 * 0.9
    assert summary["request_throughput"] == pytest.approx(5 / wall, rel=1e-3)


async def test_a_poisson_point_sends_on_its_seeded_schedule(server: str) -> None:
    point = loadgen.LoadPoint("random", 4, 8, qps=40.0, output_len=2, seed=3)
    offsets = loadgen.arrival_offsets(point)
    assert offsets == loadgen.arrival_offsets(point) and offsets[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(offsets))
    results, _ = await loadgen.run_point(server, "m", point, [[10, i, 0, 0] for i in range(8)])
    for result, offset in zip(results, offsets, strict=True):
        assert result.error is None
        assert offset - 0.005 <= result.sent_at < offset + 0.25


def test_prompts_are_exact_length_and_deterministic(tmp_path: Path) -> None:
    a = loadgen.make_prompts("random", 64, 3, 0, tmp_path, 1000)
    assert a == loadgen.make_prompts("random", 64, 3, 0, tmp_path, 1000)
    assert [len(p) for p in a] == [64, 64, 64] and a[0] != a[1]
    assert all(16 <= t < 1000 for p in a for t in p)
    with pytest.raises(ValueError, match="unknown dataset"):
        loadgen.make_prompts("poems", 64, 1, 0, tmp_path, 1000)


def _point(system: str, label: str, load: float, p50: float, p99: float) -> dict[str, Any]:
    stats = {"mean": p50 * 1.1, "p50": p50, "p99": p99}
    return {
        "system": system,
        "dataset": "random",
        "input_len": 512,
        "label": label,
        "load_kind": "qps",
        "load": load,
        "completed": 10,
        "errors": 0,
        "request_throughput": load,
        "ttft_ms": stats,
        "tpot_ms": {"mean": 5.0, "p50": 5.0, "p99": 6.0},
        "itl_ms": {"mean": 5.0, "p50": 5.0, "p99": 6.0},
    }


def test_report_ratios_table_and_plot(tmp_path: Path) -> None:
    points = [
        _point("kvpush-push", "qps 1", 1.0, 100.0, 200.0),
        _point("kvpush-push", "qps 2", 2.0, 150.0, 400.0),
        _point("vllm-pull", "qps 1", 1.0, 180.0, 500.0),
        _point("vllm-pull", "qps 2", 2.0, 300.0, 1200.0),
    ]
    document = {"meta": {"output_len": 32}, "points": points, "ratios": report.ratios(points)}
    rows = {r["label"]: r for r in document["ratios"]}
    assert rows["qps 1"]["vs"] == "vllm-pull" and rows["qps 1"]["ttft_p99"] == 2.5
    assert rows["qps 2"]["ttft_p50"] == 2.0 and rows["qps 2"]["ttft_p99"] == 3.0
    text = report.markdown(document)
    assert "### random, 512 input tokens, 32 output" in text
    assert "| vllm-pull | qps 2 | 10/0 | 2.00 | 330.0 | 300.0 | 1200.0 |" in text
    assert "| random | 512 | qps 2 | vllm-pull | 2.00 | 2.00 | 3.00 | 1.00 |" in text
    [png] = report.plots(document, tmp_path)
    assert png.name == "ttft-random-512.png"
    with Image.open(png) as image:
        assert image.size[0] >= 1000
        colors = {c for _, c in image.getcolors(1 << 20)}
        assert (214, 39, 40) in colors and (31, 119, 180) in colors  # both systems drawn
