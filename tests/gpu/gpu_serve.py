"""GPU serving check: ``kvpush up`` on one CUDA GPU, the whole stack (embedded nats-server,
gateway, a prefill and a decode worker as two vLLM engines sharing the GPU), the Llama-3-8B shape
(``kvpush model llama-8b``) with ``--load-format dummy``.

For each prompt length it asks the gateway (OpenAI completions, streamed, greedy) in mode local
(D computes the prompt: the aggregated answer), push and pull, and records the text, the time
to the first chunk, and what the gateway recorded for the request (``received``: the KV came
from P; ``fallback``: D computed it). Token identity and "the KV moved" are both in the JSON;
the script exits 1 if a push or pull answer differs from local or fell back.

Run on the GPU host (the vLLM bundle on PYTHONPATH, nats-server on PATH)::

    PYTHONUNBUFFERED=1 python3 -m tests.gpu.gpu_serve --out $OUT

Without CUDA, vLLM, nixl or nats-server it prints ``SKIP: ...`` and exits 0 (pytest does not
collect it; CI never runs it). ``--report JSON --doc DOC [--check]`` writes (checks) the table
of a committed run into its doc (``REPORT_COMMAND``; tests/benchmarks/test_docs_generated.py).

Every mode asks the same prompt, local first: P's prefix cache then holds it for pull (after
push), so pull's P leg is a cache hit; the table is a correctness check with timings for
orientation, not the serving benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.gpu.checkout import ensure_kvpush_importable

LENGTHS = (512, 2048, 8000)
MODES = ("local", "push", "pull")
REPORT_COMMAND = (
    "python3 -m tests.gpu.gpu_serve --report docs/benchmarks/gpu-serve-check.json"
    " --doc docs/benchmarks/gpu.md"
)
VLLM_REPORT_COMMAND = (
    "python3 -m tests.gpu.gpu_serve --report docs/benchmarks/gpu-serve-check-vllm.json"
    " --doc docs/benchmarks/gpu.md"
)


def section_of(result: dict[str, Any]) -> tuple[str, str]:
    """The doc section (name, command) of a run: those with vLLM's API features (every run since
    the gateway answers with vLLM's serving layer only) have their own; ``gpu-serve`` keeps the
    committed run of the gateway's older parser."""
    if "features" in result:
        return "gpu-serve-vllm", VLLM_REPORT_COMMAND
    return "gpu-serve", REPORT_COMMAND


def table(result: dict[str, Any]) -> str:
    """The committed run as a markdown table (one row per prompt), with its provenance."""
    from kvpush.benchmarks import docgen

    head = ("prompt tokens", "run", "TTFT ms local", "TTFT ms push", "TTFT ms pull")
    head += ("push = local", "pull = local", "KV received (push, pull)")
    rows = []
    for row in result["rows"]:
        by_mode = {a["mode"]: a for a in row["answers"]}
        rows.append(
            (
                row["tokens"],
                row["repeat"] + 1,
                *(f"{by_mode[m]['ttft_ms']:.1f}" for m in MODES),
                *("yes" if by_mode[m]["same_as_local"] else "NO" for m in ("push", "pull")),
                ", ".join(by_mode[m]["kv"] for m in ("push", "pull")),
            )
        )
    meta = result.get("meta", {})
    note = (
        f"`kvpush up --device cuda --load-format dummy`, model {result['model']}, "
        f"greedy, {len(result['rows'])} prompts x 3 modes; stack up in {result['start_s']} s; run "
        f"{meta.get('stamp', '?')} on {meta.get('machine', '?')} at {meta.get('revision', '?')}."
    )
    body = docgen.table(head, rows) + "\n\n" + note
    if "features" in result:  # vLLM's API through the gateway, push and pull (HTTP statuses)
        statuses = result["features"]
        names = sorted({key.split("/")[0] for key in statuses if "/" in key})
        rows = [(n, statuses[f"{n}/push"][0], statuses[f"{n}/pull"][0]) for n in names]
        version = statuses["version"]
        body += "\n\n" + docgen.table(("request", "push", "pull"), rows)
        body += f"\n\nThe gateway's `/version`: {version[1]} (HTTP {version[0]})."
    return body


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA device"
    for module in ("vllm", "nixl", "aiohttp"):
        try:
            __import__(module)
        except ImportError:
            return f"no {module}"
    if shutil.which("nats-server") is None:
        return "no nats-server on PATH"
    return None


async def ask(url: str, model: str, ids: list[int], mode: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: its text, id, time to first chunk and total time."""
    import aiohttp

    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "kvpush_mode": mode,
    }
    started = time.perf_counter()
    first, texts, rid = None, [], ""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=body) as resp,
    ):
        if resp.status != 200:
            return {"mode": mode, "error": f"{resp.status} {await resp.text()}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id", "")
            for choice in chunk.get("choices") or []:
                if first is None:
                    first = time.perf_counter()
                texts.append(choice.get("text") or "")
    done = time.perf_counter()
    return {
        "mode": mode,
        "id": rid,
        "text": "".join(texts),
        "ttft_ms": round(((first or done) - started) * 1e3, 2),
        "total_ms": round((done - started) * 1e3, 2),
    }


async def outcomes(url: str, ids: list[str]) -> dict[str, str]:
    """What the gateway recorded per request: ``received`` or ``fallback`` (its dashboard)."""
    import aiohttp

    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{url}/dashboard/data") as resp:
                rows = {r["request_id"]: r for r in (await resp.json())["requests"]}
            # vLLM's serving layer names the engine request of prompt i "<response id>-<i>"
            found = {rid: rows.get(rid) or rows.get(f"{rid}-0") for rid in ids}
            if all(found.values()) or time.monotonic() > deadline:
                return {rid: (row or {}).get("kv", "missing") for rid, row in found.items()}
            await asyncio.sleep(0.1)


FEATURES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("logprobs", "/v1/completions", {"prompt": "Hello there", "max_tokens": 8, "logprobs": 2}),
    (
        "n2_seeded",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 8, "n": 2, "seed": 3, "temperature": 1.0},
    ),
    ("echo", "/v1/completions", {"prompt": "Hi there", "max_tokens": 4, "echo": True}),
    (
        "json_schema",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a name"}],
            "max_tokens": 16,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}},
            },
        },
    ),
    ("tokenize", "/tokenize", {"prompt": "Hello there"}),
)


async def features(url: str, model: str) -> dict[str, Any]:
    """vLLM's API through the gateway (this vLLM's serving layer): the status of each request,
    push and pull."""
    import aiohttp

    statuses: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/version") as resp:
            statuses["version"] = [resp.status, (await resp.json()).get("version")]
        for name, path, body in FEATURES:
            for mode in ("push", "pull"):
                payload = {"model": model, "temperature": 0.0, **body, "kvpush_mode": mode}
                async with http.post(f"{url}{path}", json=payload) as resp:
                    statuses[f"{name}/{mode}"] = [resp.status, (await resp.text())[:300]]
    return statuses


async def exercise(url: str, model: str, repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    rows = []
    for length in LENGTHS:
        for repeat in range(repeats):
            ids = [rng.randrange(10, 2000) for _ in range(length)]
            answers = [await ask(url, model, ids, mode, max_tokens) for mode in MODES]
            moved = [a["id"] for a in answers if a["mode"] != "local" and a.get("id")]
            kv = await outcomes(url, moved)
            local = answers[0].get("text")
            for a in answers:
                a["kv"] = kv.get(a.get("id", ""), "local" if a["mode"] == "local" else "missing")
                a["same_as_local"] = a.get("text") == local
            rows.append({"tokens": length, "repeat": repeat, "answers": answers})
            print(json.dumps(rows[-1])[:400], flush=True)
    return rows


def start_up(out: Path, model_dir: Path, port: int, mode: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvpush.services.cli", "up", "--port", str(port)]
    argv += ["--model", str(model_dir), "--device", "cuda", "--load-format", "dummy"]
    argv += ["--mode", mode, "--log-dir", str(out / "logs")]
    argv += ["--trace-file", str(out / "logs" / "trace.jsonl")]
    log = open(out / "logs" / "up.log", "wb")  # noqa: SIM115 (lives as long as the child)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"kvpush is up: (http://\S+)/v1", text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"kvpush up exited {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"kvpush up not ready in {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):  # nothing of the stack may outlive the run
        os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the JSON and the logs (required to run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8411)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--report", metavar="JSON", help="render a committed run instead")
    parser.add_argument("--doc", metavar="MD", help="with --report: the doc to write")
    parser.add_argument("--check", action="store_true", help="with --doc: only compare")
    args = parser.parse_args(argv)
    if args.report:
        ensure_kvpush_importable()
        from kvpush.benchmarks import docgen

        run = json.loads(Path(args.report).read_text())
        name, command = section_of(run)
        return docgen.publish(table(run), args.doc, name, command, args.check)
    if not args.out:
        parser.error("--out is required to run")
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return 0
    ensure_kvpush_importable()
    from kvpush.services import models

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer not in the bundle
    model_dir = models.build_model(models.LLAMA_8B, Path("/tmp/kvpush-llama-8b"))
    started = time.monotonic()
    proc = start_up(out, model_dir, args.port, "push")
    result: dict[str, Any] = {"model": models.LLAMA_8B.name, "lengths": list(LENGTHS)}
    result["meta"] = {
        "stamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": os.environ.get("KVPUSH_MACHINE", "a CUDA host"),
        "revision": os.environ.get("KVPUSH_REVISION", "-"),
    }
    try:
        url = wait_up(proc, out / "logs" / "up.log", args.start_timeout_s)
        result["start_s"] = round(time.monotonic() - started, 1)
        print(f"up in {result['start_s']} s at {url}", flush=True)
        rows = asyncio.run(exercise(url, models.LLAMA_8B.name, args.repeats, args.max_tokens))
        result["rows"] = rows
        result["features"] = asyncio.run(features(url, models.LLAMA_8B.name))
        print(json.dumps(result["features"])[:2000], flush=True)
    except Exception as exc:  # keep what we have: the logs say the rest
        result["error"] = repr(exc)[:2000]
    finally:
        stop(proc)
    (out / "gpu_serve.json").write_text(json.dumps(result, indent=1))
    moved = [a for r in result.get("rows", []) for a in r["answers"] if a["mode"] != "local"]
    ok = bool(moved) and all(a["same_as_local"] and a["kv"] == "received" for a in moved)
    ok = ok and all(status == 200 for status, _ in result.get("features", {}).values())
    print(f"{'PASS' if ok else 'FAIL'}: {len(moved)} push/pull answers", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
