"""kvpush bench checksum: what the KV checksum of one transfer costs where the KV lives (issue
31's target: 2% of TTFT or less).

A pool of the model's shape (``--layers`` layers of ``--kv-heads`` x ``--head-dim`` bf16 KV,
``--block-size``-token blocks, random bytes) on ``--device``, read the way a worker reads it
(``connector.integrity.KvSums`` over the regions ``connector.layout.pool_layout`` describes;
CUDA: the Triton kernel on the side stream). For each prompt length, ``--repeats`` times:

- P (``SourceSums``): every layer counted in, as ``save_kv_layer`` does; the forward's host time
  for the layers before the last, then the sums of every layer in one pass with the last one,
  read as the done notice (or KvReady) is built: the time from the last layer's ``add`` to the
  value on the host is what the checksum adds between P's last layer and its notice;
- D (``KvSums.all_layers``): the sums of the landed blocks, before the receive is reported.

Both passes stand on the critical path of a transfer's TTFT, so their sum is the checksum's own
cost; ``--ttft LEN=MS`` (a TTFT measured by ``kvpush bench serve`` at that length) puts it as a
share of it. Nothing else runs meanwhile: the cost of the same kernels beside an engine's work
is what the serve benchmark's checked/unchecked pair measures.

``--out FILE`` writes the results as JSON; ``--report FILE [--doc DOC] [--check]`` prints (or
writes into DOC's generated section) the table of a results file instead of running.

Threading model: the caller's thread only (CUDA: the sums run on ``KvSums``' side stream).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Final

from kvpush.benchmarks import docgen

TARGET_SHARE: Final = 0.02
SECTION: Final = "checksum-cost"
LENGTHS: Final = "2048,8192"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="(cuda if any)")
    parser.add_argument("--tokens", default=LENGTHS, help=f"prompt lengths ({LENGTHS})")
    parser.add_argument("--repeats", type=int, default=50, help="timed passes per length (50)")
    parser.add_argument("--layers", type=int, default=32, help="layers (32: the 8B shape)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (128)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a block (16)")
    parser.add_argument(
        "--ttft",
        default="",
        metavar="LEN=MS,...",
        help="a measured TTFT per prompt length: the cost is shown as a share of it",
    )
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--report", metavar="FILE", help="run nothing: the table of FILE")
    parser.add_argument("--doc", metavar="DOC", help="with --report: write it into DOC")
    parser.add_argument("--check", action="store_true", help="with --report --doc: only compare")


def _lengths(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _ttfts(text: str) -> dict[int, float]:
    pairs = (part.split("=", 1) for part in text.split(",") if part.strip())
    return {int(length): float(ms) for length, ms in pairs}


def _pool(args: argparse.Namespace, blocks: int, device: Any) -> list[Any]:
    """One KV tensor per layer, ``[blocks, block_size, kv_heads, 2 * head_dim]`` bf16 of random
    bytes (each block dense, the way a worker registers it)."""
    import torch

    shape = (blocks, args.block_size, args.kv_heads, 2 * args.head_dim)
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device, generator=gen)
        .view(torch.bfloat16)
        .contiguous()
        for _ in range(args.layers)
    ]


def _ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(seconds) * 1e3, 3), "p99_ms": round(p99 * 1e3, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvpush.connector.integrity import KvSums, SourceSums
    from kvpush.connector.layout import pool_layout

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lengths, ttfts = _lengths(args.tokens), _ttfts(args.ttft)
    blocks = max(lengths) // args.block_size + 1
    layers = _pool(args, blocks, device)
    kv = KvSums(pool_layout([[t] for t in layers]), [[t] for t in layers])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases = []
    for length in lengths:
        ids = list(range(1, length // args.block_size + 1))
        adds, p_pass, d_pass = [], [], []
        for _ in range(args.repeats + 2):  # the first two: warm-up, not kept
            sync()
            source = SourceSums(kv, ids)
            started = time.perf_counter()
            for layer in range(args.layers - 1):
                source.add(layer)
            last = time.perf_counter()
            source.add(args.layers - 1)
            sent = source.value()
            read = time.perf_counter()
            got = kv.all_layers(ids)
            verified = time.perf_counter()
            assert sent is not None and (sent == got).all()  # the same bytes, the same sums
            adds.append(last - started)
            p_pass.append(read - last)
            d_pass.append(verified - read)
        adds, p_pass, d_pass = adds[2:], p_pass[2:], d_pass[2:]
        both = [p + d for p, d in zip(p_pass, d_pass, strict=True)]
        kv_bytes = len(ids) * args.layers * layers[0][0].numel() * layers[0].element_size()
        case: dict[str, Any] = {
            "prompt_tokens": length,
            "kv_bytes": kv_bytes,
            "p_layers_host_us": round(statistics.median(adds) * 1e6 / (args.layers - 1), 2),
            "p_pass": _ms(p_pass),
            "d_pass": _ms(d_pass),
            "both": _ms(both),
        }
        if length in ttfts:
            case["ttft_ms"] = ttfts[length]
            case["share"] = round(case["both"]["p50_ms"] / ttfts[length], 5)
        cases.append(case)
        print(f"  {length} tokens: {case}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    return {
        "meta": {
            "stamp": docgen.stamp(),
            "revision": docgen.revision(),
            "device": device.type,
            "device_name": name,
            "kernel": kv.kernel,
            "shape": {
                "layers": args.layers,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "block_size": args.block_size,
            },
            "repeats": args.repeats,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "target_share": TARGET_SHARE,
        "cases": cases,
    }


def table(results: dict[str, Any]) -> str:
    target = results["target_share"]
    rows = []
    for c in results["cases"]:
        share = c.get("share")
        verdict = "-" if share is None else ("met" if share <= target else "missed")
        rows.append(
            (
                c["prompt_tokens"],
                f"{c['kv_bytes'] / 2**20:.1f}",
                f"{c['p_layers_host_us']:.2f}",
                f"{c['p_pass']['p50_ms']:.3f} / {c['p_pass']['p99_ms']:.3f}",
                f"{c['d_pass']['p50_ms']:.3f} / {c['d_pass']['p99_ms']:.3f}",
                f"{c['both']['p50_ms']:.3f}",
                "-" if share is None else f"{share:.2%} of {c['ttft_ms']:g} ms",
                verdict,
            )
        )
    head = (
        "prompt tokens",
        "KV read per side, MiB",
        "P: host time per layer before the last, us",
        "P: last layer to checksum on the host, ms (P50 / P99)",
        "D: landed blocks' sums, ms (P50 / P99)",
        "P + D, ms (P50)",
        "share of the TTFT",
        f"<= {target:.0%}",
    )
    meta, shape = results["meta"], results["meta"]["shape"]
    note = (
        f"{meta['device']} ({meta['device_name']}, sums by {meta['kernel']}),"
        f" {shape['layers']} layers of"
        f" {shape['kv_heads']} KV heads x {shape['head_dim']} bf16, {shape['block_size']}-token"
        f" blocks; {meta['repeats']} passes per row, nothing else running; torch {meta['torch']},"
        f" Python {meta['python']}; run {meta['stamp']} at {meta['revision']}."
    )
    return docgen.table(head, rows) + "\n\n" + note


def main(args: argparse.Namespace) -> int:
    if args.report:
        command = f"kvpush bench checksum --report {args.report} --doc {args.doc}"
        return docgen.publish_report(args, table, SECTION, command)
    results = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0
