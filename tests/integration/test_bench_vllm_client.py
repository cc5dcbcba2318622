"""vLLM's own client as the benchmark's load (``vllm_client``): real ``vllm bench serve`` runs
(one client process, vLLM imported once, point after point) against a scripted OpenAI server,
read back into the records kvpush's reports are made of.

No engine: the server streams a scripted answer; what is checked is what crosses the two
programs (the request ids and extra body fields vLLM's client sends, its per-request TTFT and
gaps, texts and failures as ``RequestResult``s)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from kvpush.benchmarks.serve import loadgen, vllm_client
from tests.http_server import serving_completions

GAP_S = 0.02


async def test_a_point_sent_by_vllm_bench_serve_reads_back_per_request(
    tiny_model: Path, tmp_path: Path
) -> None:
    seen: list[tuple[str, dict]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        request_id = request.headers.get("X-Request-Id", "")
        seen.append((request_id, body))
        if request_id.endswith("-2"):  # the scripted failure
            return web.json_response({"error": {"message": "boom"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(GAP_S)
            chunk = {"id": "cmpl-x", "choices": [{"text": f" w{i}", "index": 0}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 64, "completion_tokens": body["max_tokens"]}
        final = {"id": "cmpl-x", "choices": [], "usage": usage}
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    point = loadgen.LoadPoint("prefix", 64, 4, concurrency=2, output_len=4, seed=7)
    client = vllm_client.BenchClient(tmp_path / "client.log")
    try:
        async with serving_completions(completions) as url:
            found, wall = await vllm_client.run_point(
                client, url, "m", tiny_model, point, tmp_path, "p1-", extra={"kvpush_mode": "push"}
            )
            # the same client process runs the next points (vLLM imported once), a point that
            # fails (vLLM's parser refuses its arguments) included
            pid = client._process.pid if client._process else None
            refused = await client.run(["--no-such-flag"], tmp_path / "refused.log", 120.0)
            assert refused["rc"] == 2 and "no-such-flag" in (tmp_path / "refused.log").read_text()
            again = loadgen.LoadPoint("random", 32, 2, concurrency=1, output_len=2, seed=8)
            second, _ = await vllm_client.run_point(
                client, url, "m", tiny_model, again, tmp_path, "p2-"
            )
            assert client._process is not None and client._process.pid == pid
    finally:
        await client.close()
    assert [r.request_id for r in second] == ["p2-0", "p2-1"]
    assert all(r.error is None and r.output_tokens == 2 for r in second)
    seen = [(rid, body) for rid, body in seen if rid.startswith("p1-")]
    assert sorted(rid for rid, _ in seen) == ["p1-0", "p1-1", "p1-2", "p1-3"]
    assert all(body["kvpush_mode"] == "push" and body["ignore_eos"] for _, body in seen)
    assert all(body["max_tokens"] == 4 and body["temperature"] == 0 for _, body in seen)
    assert [r.request_id for r in found] == ["p1-0", "p1-1", "p1-2", "p1-3"]
    failed = [r for r in found if r.error is not None]
    assert len(failed) == 1 and failed[0].ttft_s is None
    for r in (r for r in found if r.error is None):
        assert r.text == " w0 w1 w2 w3" and r.output_tokens == 4 and len(r.itl_s) == 3
        assert r.ttft_s is not None and r.e2e_s is not None and r.e2e_s >= r.ttft_s + 2 * GAP_S
    summary = loadgen.summarize(found, wall)
    assert summary["completed"] == 3 and summary["errors"] == 1 and wall > 0
    assert summary["tpot_ms"]["p50"] >= GAP_S * 1e3 * 0.8
