"""``kvpush bench serve`` itself, run as a user runs it, on the tiny model: it starts each system
once per repeat, drives it, checks every point for requests served without a KV transfer,
stops it, and writes a well-formed report (JSON, generated markdown, plot) that
``kvpush bench report --check`` accepts. And a kvpush point whose requests are served locally
(no transfer) fails its check.

Systems here: both kvpush modes and vLLM's aggregated server (the vLLM-peer code path); the
P/D peers of vLLM run in the real benchmark (docs/benchmarks/serve.md), not in CI: two more
vLLM servers would cost minutes of a 2-core CI box.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from kvpush.benchmarks.serve import plan
from kvpush.benchmarks.serve.run import Bench
from kvpush.benchmarks.serve.systems import BenchContext, KvpushPush
from kvpush.services import models
from kvpush.services.telemetry.breakdown import PART_NAMES

pytestmark = pytest.mark.engine

SYSTEMS = ("kvpush-push", "kvpush-pull", "aggregated")
LABELS = ("qps 4", "c=2")


def test_bench_serve_runs_every_system_and_writes_a_well_formed_report(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serve"
    argv = [sys.executable, "-m", "kvpush.services.cli", "bench", "serve"]
    argv += ["--model", str(tiny_model), "--systems", ",".join(SYSTEMS)]
    argv += ["--tables", "random:192", "--qps", "4", "--concurrency", "2", "--duration", "1"]
    argv += ["--min-requests", "4", "--output-len", "4", "--repeats", "2", "--out-dir", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())

    assert document["schema"] == 2 and document["meta"]["tables"] == ["random:192"]
    for name in SYSTEMS:
        runs = document["systems"][name]
        assert runs["ok"] and [r["repeat"] for r in runs["runs"]] == [0, 1], runs
    assert document["meta"]["output_len"] == 4 and document["rates_by_len"] == {"192": [4.0]}
    points = {(p["system"], p["label"], p["repeat"]): p for p in document["points"]}
    assert set(points) == {(s, label, r) for s in SYSTEMS for label in LABELS for r in (0, 1)}
    for label in LABELS:  # the same prompts for every system, new ones each repeat
        seeds = [{points[(s, label, r)]["seed"] for s in SYSTEMS} for r in (0, 1)]
        assert all(len(s) == 1 for s in seeds) and seeds[0] != seeds[1]
    for (system, label, _repeat), p in points.items():
        want = 4 if label == "qps 4" else 8  # --min-requests 4; fixed concurrency: 4 x c
        assert p["completed"] == p["requests"] == want and p["errors"] == 0, p
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"], p
        assert p["tpot_ms"]["mean"] > 0 and p["itl_ms"]["p50"] > 0, p
        check = p["transfer_check"]
        if system.startswith("kvpush"):
            mode = system.removeprefix("kvpush-")
            assert check["applies"] and check["ok"] and check["checked"] == want, check
            assert check["counts"] == {f"routed.{mode}": want, f"outcome.{mode}.received": want}
            parts = p["breakdown"]
            assert parts["requests"] == want and set(PART_NAMES) <= set(parts), p
            assert parts["prefill_compute"]["p50"] > 0, parts
        else:
            assert not check["applies"] and check["ok"], check
            assert "breakdown" not in p or p["breakdown"] is None
    ratios = {(r["vs"], r["label"]) for r in document["ratios"]}
    assert ratios == {(s, label) for s in SYSTEMS[1:] for label in LABELS}
    assert [v["key"] for v in document["verdicts"]] == ["T1", "T2", "T3", "T4"]

    text = (out / "results.md").read_text()
    assert text.startswith("<!-- generated: serve (kvpush bench report ")
    assert "### random, 192 input tokens" in text and "### Targets" in text
    for system in SYSTEMS:
        assert f"| qps 4 | {system} |" in text
    assert "| ok (8) |" in text and "| ok (16) |" in text and "| n/a |" in text
    assert "FAILED" not in text and "kvpush TTFT breakdown" in text and "Ratios" in text
    with Image.open(out / "ttft-random-192.png") as image:
        assert image.format == "PNG" and image.width >= 1000
    assert "kvpush-push" in done.stderr  # progress lines went to stderr

    check = [sys.executable, "-m", "kvpush.services.cli", "bench", "report"]
    check += [str(out / "results.json"), "--out", str(out / "results.md"), "--check"]
    checked = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr


async def test_a_kvpush_point_served_without_transfer_fails_its_check(
    tiny_model: Path, tmp_path: Path
) -> None:
    served = str(models.read_stamp(tiny_model)["recipe"]["name"])
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    ctx = BenchContext(tiny_model, served, tmp_path / "logs")
    table = plan.Table("random", 192)
    the_plan = plan.Plan(("kvpush-push",), (table,), "4", (), 1, 1.0, 4, 4)
    [spec] = plan.points(the_plan, table, plan.fixed_rates("4"), 0)
    system = KvpushPush()
    system.request_extra = {"kvpush_mode": "local"}  # D computes every prompt itself
    url = await system.start(ctx)
    try:
        point = await Bench(ctx, the_plan, vocab).measure(system, url, spec, 0.0)
    finally:
        await system.stop()
    assert point.completed == 4 and point.errors == 0
    check = point.transfer_check
    assert check is not None and check.applies and not check.ok, check
    assert check.without_transfer == 4 and check.counts == {"routed.local": 4.0}
    assert "routed not push: local 4" in check.detail and "received 0 of 4" in check.detail
    # the gateway's rows of the point (run.py reads them for every KvpushSystem): all four,
    # routed local by the request's own override, with their TTFT parts
    assert point.routing is not None and point.routing["requests"] == 4, point.routing
    assert point.routing["groups"].keys() == {"local/override"}, point.routing
    assert "of" not in point.routing
    assert point.breakdown is not None and point.breakdown["requests"] == 4, point.breakdown
