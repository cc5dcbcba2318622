"""Transport benchmark: kvpush push/pull between two processes vs a raw NIXL WRITE and memcpy.

The KV pools (``transport_side.py``): --device cpu, the bench model's KV in vLLM's CPU layout;
--device cuda, the Llama-3-8B shape's KV (16 MiB per 128-token block) in vLLM's FlashAttention
layout on one GPU. Cases of 512, 2048 and 8192 tokens (128-token blocks). This process is the
prefill side; a spawned child is the decode side (its Poller polls as a kvpush worker's does).
For every case, after one verified warm-up (byte-exact digests), the median over --repeats of
(each op starts with caches swept cold):

  push       one WRITE per layer (push_layers after each layer) + finish: P blocks [0, n) into D
             blocks [8, 8+n); timed from the first post until poll() reports DONE (every WRITE
             done, completion notice sent). start_push (announcement arrived, prefill still
             computing: off the critical path) is timed on its own, and so is the tail: last
             post -> DONE
  push-1req  the same bytes in one request, timed from start_push (announcement arrived after
             prefill ended: everything is on the critical path)
  push-frag  one request per layer into D blocks in 2-block runs
  pull       one READ of all layers + the notice to the block owner (the KvReady flow)
  raw        one single-descriptor NIXL WRITE of the same bytes between two plain buffers;
             also as one such WRITE per layer-sized chunk (push's request structure), and one
             single-descriptor READ (pull's comparison)
  memcpy     a copy of the same bytes inside one process (numpy; cuda: device to device)
  stream     the push as the connector runs it in serving: announcement first, each layer
             pushed once computed (--layer-ms of compute per layer; on CUDA the layer gate's
             thread posts once the GPU ran the layer, as in serving), both sides driven by
             Pollers with a worker's intervals (--poll-us overrides them). Reports the
             forward thread's cost per layer and the tail from the last layer computed to P's
             DONE and to D seeing it: the push's fixed cost per transfer on the critical path

GB/s are 1e9 bytes per second. --json OUT writes {"cases": [{"tokens", "push_GBps",
"pull_GBps", "raw_GBps", "memcpy_GBps", "stream_d_tail_us", ...}]}.

This module is the command (its flags, ``main``); the prefill side's timed operations are
``transport_prefill.PrefillBench``, the decode side and the pools ``transport_side.py``, the
tables ``transport_report.py``.

Threading model: the main thread drives the cases; the decode side is a spawned process.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvpush.benchmarks.transport_prefill import PrefillBench
from kvpush.benchmarks.transport_side import (
    BLOCK_SIZE,
    decode_side,
    intervals,
    make_setup,
    poll_us,
)


def _poll_us(text: str) -> tuple[float, float]:
    """``BUSY,TARGET`` in us -> (busy, target) in seconds."""
    try:
        busy, target = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want BUSY,TARGET in us, e.g. 50,200") from None
    if busy <= 0 or target <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: intervals must be positive")
    return busy / 1e6, target / 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="run nothing: print the summary of DIR/run-*.json (earlier --json outputs): "
        "medians over the runs, ratio spreads, one line per run",
    )
    parser.add_argument(
        "--doc",
        metavar="FILE",
        help="with --report: write the summary into FILE's generated section",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --report --doc: change nothing, exit 1 if FILE is not what DIR generates",
    )
    parser.add_argument("--repeats", type=int, default=25, help="timed repeats per case")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[512, 2048, 8192],
        help="prompt lengths (multiples of 128)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the KV lives: cpu (the bench model's KV, numpy) or cuda (the Llama-3-8B "
        "shape's KV in vLLM's FlashAttention layout on --gpu, torch; READs with cuda_ipc "
        "GET zero-copy on)",
    )
    parser.add_argument("--gpu", type=int, default=0, help="cuda: the GPU of both sides")
    parser.add_argument(
        "--layer-ms",
        type=float,
        default=1.0,
        help="the streamed case: one layer's compute in ms (default 1.0; an 8B prefill of 2k "
        "tokens on an H200 is ~1.6 ms a layer)",
    )
    parser.add_argument(
        "--poll-us",
        metavar="BUSY,TARGET",
        type=_poll_us,
        default=None,
        help="the streamed case: the pollers' busy and target intervals in us (default: what "
        "a kvpush worker uses)",
    )
    parser.add_argument(
        "--stream-only",
        action="store_true",
        help="measure the streamed case alone (and one idle poll's cost): to compare settings",
    )
    parser.add_argument(
        "--error-mode",
        choices=["none", "peer"],
        default="none",
        help="UCX ucx_error_handling_mode (default none: CMA + shared memory)",
    )
    parser.add_argument(
        "--descriptors",
        choices=["prepped", "rows"],
        default="prepped",
        help="prepped per-block lists (default) or coalesced rows per request",
    )


def main(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    from kvpush.benchmarks import docgen, transport_report

    if args.report:
        return transport_report.report(Path(args.report), args.doc, args.check)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if any(t % BLOCK_SIZE or t <= 0 for t in args.tokens):
        print(f"--tokens must be positive multiples of {BLOCK_SIZE}")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("kvpush bench transport: --device cuda, but torch sees no CUDA device")
            return 2
    setup = make_setup(
        args.device, args.gpu, args.tokens, args.error_mode, args.descriptors == "prepped"
    )
    setup["intervals"] = intervals(args.poll_us, args.device == "cuda")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, setup), daemon=True)
    proc.start()
    bench = None
    try:
        if not parent.poll(120.0):
            raise TimeoutError("decode side did not start")
        bench = PrefillBench(setup, parent)
        started = time.monotonic()
        layer_s = args.layer_ms / 1e3
        cases = [
            bench.case(tokens, args.repeats, layer_s, args.stream_only) for tokens in args.tokens
        ]
        print(
            f"kvpush bench transport: two processes on {args.device}, UCX error mode "
            f"{args.error_mode}, {args.descriptors} descriptors, median of {args.repeats} "
            f"({time.monotonic() - started:.1f}s, load {os.getloadavg()[0]:.2f})"
        )
        elapsed_s, load = time.monotonic() - started, os.getloadavg()[0]
        settings = {
            "device": args.device,
            "error_mode": args.error_mode,
            "descriptors": args.descriptors,
            "repeats": args.repeats,
            "layer_ms": args.layer_ms,
            "poll_us": poll_us(setup["intervals"]),
        }
        cases = [{**case, **settings} for case in cases]
        if not args.stream_only:
            print(transport_report.table(cases))
        print(transport_report.stream_table(cases))
        if args.json:
            meta = {
                "date": docgen.stamp(),
                "kvpush_rev": docgen.revision(),
                "repeats": args.repeats,
                "elapsed_s": round(elapsed_s, 1),
                "load_avg": round(load, 2),
            }
            document = {"meta": meta, "cases": cases}
            with open(args.json, "w") as f:
                json.dump(document, f, indent=1)
        return 0
    finally:
        if bench is not None:
            bench.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
