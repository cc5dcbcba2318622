"""kvpush bench serve: kvpush push/pull against vLLM's own connectors and one vLLM engine.

Starts each system in turn on this machine with the same model (default: the bench model from
`kvpush model bench`, built if missing), the same cores (prefill core 0, decode core 1; the
aggregated engine on core 0) and the same request trace, and drives it over HTTP
(/v1/completions, streamed, token-id prompts, ignore_eos):

  kvpush-push   kvpush up --mode push (P WRITEs KV into blocks D announced)
  kvpush-pull   kvpush up --mode pull (D READs P's blocks after prefill)
  vllm-pull     two vLLM OpenAI servers with NixlConnector and a sequential proxy
  vllm-push     two vLLM OpenAI servers with NixlPushConnector, both legs sent at once
  aggregated    one vLLM OpenAI server, no disaggregation

Load: Poisson arrivals at a QPS sweep (default: fractions of the prefill capacity measured at
each input length) and fixed concurrency; input lengths 512/1024/2048; random or sonnet-like
prompts. Per point: TTFT mean/P50/P99, TPOT, ITL, throughput, errors, and kvpush's TTFT
breakdown. Writes results.json, results.md and TTFT-vs-QPS plots into --out-dir.
(Code: systems.py, vllm_systems.py, loadgen.py, run.py, report.py, plot.py; this __init__
holds only the command line, imported by `kvpush --help`.)
"""

from __future__ import annotations

import argparse

ALL_SYSTEMS = ("kvpush-push", "kvpush-pull", "vllm-pull", "vllm-push", "aggregated")
CAPACITY_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.05)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--systems", default=",".join(ALL_SYSTEMS), help="comma list (default: all five)")
    add("--model", default="bench", help="model folder, or 'bench' / 'tiny' (built if missing)")
    add("--input-lens", default="512,1024,2048", type=_ints, help="prompt lengths (tokens)")
    add("--datasets", default="random", help="random and/or sonnet (comma list)")
    add("--output-len", default=32, type=int, help="output tokens per request (ignore_eos)")
    add(
        "--qps",
        default="auto",
        help="Poisson rates, comma list, or 'auto': "
        + ", ".join(f"{f:g}" for f in CAPACITY_FRACTIONS)
        + " x the prefill capacity probed per input length (default auto)",
    )
    add("--concurrency", default=[1, 4], type=_ints, help="fixed-concurrency points (1,4)")
    add("--duration", default=40.0, type=float, help="seconds of arrivals per QPS point (40)")
    add("--min-requests", default=12, type=int, help="at least this many per point (12)")
    add("--quick", action="store_true", help="smoke run: 512 tokens, qps 1, c=2, 8 requests")
    add("--out-dir", default="bench-results/serve", help="results.json/.md and plots go here")
    add("--log-dir", default=None, help="systems' logs (default OUT_DIR/logs)")
    add("--json", metavar="OUT", help="also write the JSON document here")
    add(
        "--trace",
        action="store_true",
        help="kvpush systems also write spans (OUT_DIR/traces/<system>.jsonl): for "
        "`kvpush ttft`, and to measure what tracing costs (compare with a run without)",
    )
