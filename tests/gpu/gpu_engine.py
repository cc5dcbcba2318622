"""GPU engine-mode probe (issue 29): one system on one H200, start to ready, then vLLM's own
``vllm bench serve`` client (random prompts, fresh seed per point) at concurrency 1 and at
Poisson rates. Systems: ``kvpush`` (``kvpush up --device cuda`` with the given worker flags;
its defaults run each engine as ``vllm serve`` does: engine-core process, CUDA graphs, async
scheduling) and ``vllm-serve`` (``vllm serve`` with its defaults), both on the Llama-3-8B
shape with dummy weights. Writes ``OUT/<system>.json``: start seconds and vLLM bench's result
per point. A probe to settle the engine mode on the device, not the committed benchmark
(``kvpush bench serve``).

Run on the GPU host (the vLLM bundle on PYTHONPATH, nats-server on PATH)::

    python3 -m tests.gpu.gpu_engine --out $OUT --system kvpush [--flag=--enforce-eager]

``--starts N``: start (and stop) the system N times in a row before its points; each start's
seconds are in ``start_s_each``: the first is cold on a fresh host, the later ones restarts on
the same host (compile caches, and kvpush's remembered KV memory, warm).

``--trace TAG`` (kvpush): every service traces to ``OUT/TAG-trace.jsonl``; after the points
the stack stops and ``kvpush ttft`` writes the TTFT breakdown to ``OUT/TAG-ttft.txt`` and
``OUT/TAG-ttft.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.gpu.checkout import ensure_kvpush_importable


def start(system: str, out: Path, model_dir: Path, port: int, extra: list[str]) -> Any:
    log = open(out / f"{system}.log", "wb")  # noqa: SIM115 (lives as long as the child)
    if system == "kvpush":
        argv = [sys.executable, "-m", "kvpush.services.cli", "up", "--port", str(port)]
        argv += ["--model", str(model_dir), "--device", "cuda", "--load-format", "dummy"]
        argv += ["--log-dir", str(out / "logs"), *extra]
    else:
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
        argv += ["--port", str(port), "--load-format", "dummy", "--served-model-name"]
        argv += ["llama-8b", "--gpu-memory-utilization", "0.85", *extra]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: Any, url: str, log: Path, timeout_s: float) -> str:
    """The served model's name once a completion of it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body)
            req.add_header("Content-Type", "application/json")
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return str(model)
        time.sleep(1.0)
    raise TimeoutError(f"not ready in {timeout_s} s")


def bench(
    url: str, model: str, model_dir: Path, out: Path, name: str, seed: int, **point: Any
) -> Any:
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    argv += ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", model, "--tokenizer", str(model_dir), "--dataset-name", "random"]
    argv += ["--random-input-len", str(point["input_len"]), "--random-output-len", "64"]
    argv += ["--ignore-eos", "--num-prompts", str(point["prompts"]), "--seed", str(seed)]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    argv += ["--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    if "concurrency" in point:
        argv += ["--max-concurrency", str(point["concurrency"])]
    argv += ["--request-rate", str(point.get("rate", "inf"))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    print(done.stdout[-1500:], flush=True)
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {"error": done.stderr[-2000:]}


def stop(proc: Any) -> None:
    """SIGINT (a clean stop), then the whole process group killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def gpu_memory_freed(timeout_s: float = 90.0) -> None:
    """Wait until the GPU's memory is back (under 2 GiB used) after a stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        used = subprocess.run(query, capture_output=True, text=True).stdout.split()
        if used and int(used[0]) < 2048:
            return
        time.sleep(1.0)


POINTS = (
    ("c1-2048", {"input_len": 2048, "concurrency": 1, "prompts": 24}),
    ("c1-8192", {"input_len": 8192, "concurrency": 1, "prompts": 12}),
    ("r8-2048", {"input_len": 2048, "rate": 8, "prompts": 120}),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--system", choices=("kvpush", "vllm-serve"), default="kvpush")
    parser.add_argument("--flag", action="append", default=[], help="extra flag of the system")
    parser.add_argument("--points", default=",".join(name for name, _ in POINTS))
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--trace", metavar="TAG", help="kvpush: trace and break TTFT down")
    parser.add_argument("--start-timeout-s", type=float, default=400.0)
    parser.add_argument("--starts", type=int, default=1, help="start N times (restarts: warm)")
    args = parser.parse_args()
    ensure_kvpush_importable()
    from kvpush.services import models

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    model_dir = models.build_model(models.LLAMA_8B, Path("/tmp/kvpush-llama-8b"))
    url = f"http://127.0.0.1:{args.port}"
    result: dict[str, Any] = {"system": args.system, "flags": args.flag, "points": {}}
    flags = list(args.flag)
    trace = out / f"{args.trace}-trace.jsonl" if args.trace else None
    if trace is not None:
        flags += ["--trace-file", str(trace)]
    name = args.trace or args.system
    result["start_s_each"] = []
    for _ in range(args.starts - 1):  # the restarts' starts: ready, then stopped again
        started = time.monotonic()
        proc = start(args.system, out, model_dir, args.port, flags)
        try:
            wait_ready(proc, url, out / f"{args.system}.log", args.start_timeout_s)
            result["start_s_each"].append(round(time.monotonic() - started, 1))
            print(f"{args.system} ready in {result['start_s_each'][-1]} s", flush=True)
        finally:
            stop(proc)
            gpu_memory_freed()
    started = time.monotonic()
    proc = start(args.system, out, model_dir, args.port, flags)
    try:
        model = wait_ready(proc, url, out / f"{args.system}.log", args.start_timeout_s)
        result["start_s"] = round(time.monotonic() - started, 1)
        result["start_s_each"].append(result["start_s"])
        print(f"{args.system} ready in {result['start_s']} s", flush=True)
        wanted = args.points.split(",")
        for seed, (point_name, point) in enumerate(POINTS, start=100):
            if point_name in wanted:
                got = bench(url, model, model_dir, out, f"{name}-{point_name}", seed, **point)
                keep = ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
                keep += ("output_throughput", "completed", "failed", "error")
                result["points"][point_name] = {k: got.get(k) for k in keep if k in got}
                print(point_name, result["points"][point_name], flush=True)
    except Exception as exc:
        result["error"] = repr(exc)[:2000]
        print("ERROR", result["error"], flush=True)
    finally:
        stop(proc)
    if trace is not None and trace.exists():
        argv = [sys.executable, "-m", "kvpush.services.cli", "ttft", str(trace)]
        argv += ["--json", str(out / f"{name}-ttft.json")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        summary = done.stdout + done.stderr
        (out / f"{name}-ttft.txt").write_text(summary)
        print(summary[-2500:], flush=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
