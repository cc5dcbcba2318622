"""Request traces and the HTTP load generator of ``kvpush bench serve``.

A ``LoadPoint`` is one measurement: Poisson arrivals at ``qps`` (seeded exponential gaps) or a
fixed ``concurrency`` (that many clients sending back to back), ``requests`` requests of one
input length from one dataset, ``output_len`` tokens each with ``ignore_eos``. Prompts are token
id lists of exactly the input length, the same for every system (same seed):

- ``random``: uniform token ids (no prefix sharing at all);
- ``sonnet``: a shared instruction followed by lines of locally generated prose (the model's
  own training text generator), tokenized with the model's tokenizer and cut to length: the
  prefix is shared between requests like vLLM's sonnet set, so prefix caches take part.

``run_point`` streams every request (``stream_options.include_usage``, no continuous usage)
and records, per request, TTFT (request sent -> first chunk with a token), the inter-token
gaps (ITL), the end-to-end time, errors, a digest of the completion (token identity across
systems: the same prompts at a point, greedy), and from the final usage chunk the prompt tokens and
``prompt_tokens_details.cached_tokens`` where the server reports them (vLLM with
``--enable-prompt-tokens-details``; ``checks.py`` reads them). ``extra`` fields go into every
request body (kvpush systems: ``kvpush_mode``). ``summarize`` turns a point's results into the
reported numbers.

Threading model: asyncio on the caller's loop; one aiohttp session per point.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvpush.services import model_tokenizer

SONNET_PREFIX = "Pick as many lines as you can from these poem lines and recite them:\n"


@dataclass(frozen=True)
class LoadPoint:
    dataset: str  # random | sonnet
    input_len: int
    requests: int
    qps: float | None = None  # Poisson arrivals
    concurrency: int | None = None  # or: fixed concurrency
    output_len: int = 32
    seed: int = 0

    @property
    def label(self) -> str:
        return f"qps {self.qps:g}" if self.qps is not None else f"c={self.concurrency}"

    @property
    def load(self) -> float:
        """The x value of plots: QPS, or concurrency for fixed-concurrency points."""
        return float(self.qps if self.qps is not None else self.concurrency or 0)


@dataclass
class RequestResult:
    index: int
    input_len: int
    sent_at: float = 0.0  # perf_counter seconds since the point started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    request_id: str = ""
    error: str | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    text: str = ""  # the completion, streamed chunks joined

    @property
    def digest(self) -> str:
        """A short digest of the completion ("" when it failed): equal across systems when
        they answered the same prompt with the same tokens."""
        if self.error is not None:
            return ""
        return hashlib.blake2b(self.text.encode(), digest_size=6).hexdigest()


def make_prompts(
    dataset: str, input_len: int, count: int, seed: int, model_dir: Path, vocab_size: int
) -> list[list[int]]:
    """``count`` prompts of exactly ``input_len`` token ids (deterministic per seed)."""
    rng = random.Random(f"{dataset}-{input_len}-{seed}")
    if dataset == "random":
        return [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(count)]
    if dataset != "sonnet":
        raise ValueError(f"unknown dataset {dataset!r} (random, sonnet)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prefix = tokenizer.encode(SONNET_PREFIX, add_special_tokens=False)
    lines = list(model_tokenizer.prose_lines(seed + 7919, 4000))
    prompts = []
    for _ in range(count):
        ids = list(prefix)
        while len(ids) < input_len:
            ids += tokenizer.encode(rng.choice(lines) + "\n", add_special_tokens=False)
        prompts.append(ids[:input_len])
    return prompts


def arrival_offsets(point: LoadPoint) -> list[float]:
    """Send times (seconds from the start) of a Poisson point: exponential gaps, seeded."""
    assert point.qps is not None and point.qps > 0
    rng = random.Random(f"arrivals-{point.seed}-{point.qps}-{point.input_len}")
    t, offsets = 0.0, []
    for _ in range(point.requests):
        offsets.append(t)
        t += rng.expovariate(point.qps)
    return offsets


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    origin: float,
    timeout_s: float,
) -> None:
    started = time.perf_counter()
    result.sent_at = started - origin
    last = started
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                result.request_id = result.request_id or str(chunk.get("id", ""))
                if usage := chunk.get("usage"):
                    _read_usage(usage, result)
                choices = chunk.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("finish_reason")):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - started
                elif choices[0].get("text"):
                    result.itl_s.append(now - last)
                result.text += choices[0].get("text") or ""
                last = now
        result.e2e_s = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]


def _read_usage(usage: dict[str, Any], result: RequestResult) -> None:
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


async def run_point(
    url: str,
    served_name: str,
    point: LoadPoint,
    prompts: list[list[int]],
    progress: Callable[[], None] | None = None,
    timeout_s: float = 600.0,
    extra: Mapping[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send the point's requests; (results in request order, wall seconds of the point)."""
    results = [RequestResult(i, point.input_len) for i in range(point.requests)]

    def body(i: int) -> dict[str, Any]:
        return {
            "model": served_name,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": point.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
            **(extra or {}),
        }

    async def send(i: int, session: aiohttp.ClientSession, origin: float) -> None:
        await _one(session, url, body(i), results[i], origin, timeout_s)
        if progress is not None:
            progress()

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        origin = time.perf_counter()
        if point.qps is not None:
            tasks = []
            for i, offset in enumerate(arrival_offsets(point)):
                delay = origin + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(i, session, origin)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(range(point.requests))

            async def client() -> None:
                for i in queue:
                    await send(i, session, origin)

            await asyncio.gather(*(client() for _ in range(point.concurrency or 1)))
        return results, time.perf_counter() - origin


def _stats(values: list[float], scale: float = 1e3) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    array = np.asarray(values) * scale
    return {
        "mean": round(float(array.mean()), 3),
        "p50": round(float(np.percentile(array, 50)), 3),
        "p99": round(float(np.percentile(array, 99)), 3),
    }


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """The reported numbers of one point (times in ms)."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None and r.e2e_s is not None]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None
    ]
    return {
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "wall_s": round(wall_s, 3),
        "request_throughput": round(len(ok) / wall_s, 4) if wall_s > 0 else 0.0,
        "output_throughput": round(sum(r.output_tokens for r in ok) / wall_s, 2) if wall_s else 0,
        "ttft_ms": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_digests": [r.digest for r in results],
    }
