"""``kvpush bench serve`` itself, run as a user runs it, on the tiny model: it starts each system,
drives it, stops it, and writes a well-formed report (JSON, markdown, plot).

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

from kvpush.services.telemetry.breakdown import PART_NAMES

pytestmark = pytest.mark.engine

SYSTEMS = ("kvpush-push", "kvpush-pull", "aggregated")


def test_bench_serve_runs_every_system_and_writes_a_well_formed_report(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serve"
    argv = [sys.executable, "-m", "kvpush.services.cli", "bench", "serve"]
    argv += ["--model", str(tiny_model), "--systems", ",".join(SYSTEMS)]
    argv += ["--input-lens", "192", "--qps", "4", "--concurrency", "2", "--duration", "1"]
    argv += ["--min-requests", "4", "--output-len", "4", "--out-dir", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())

    assert {n: s["ok"] for n, s in document["systems"].items()} == dict.fromkeys(SYSTEMS, True)
    assert document["meta"]["output_len"] == 4 and document["rates_by_len"] == {"192": [4.0]}
    points = {(p["system"], p["label"]): p for p in document["points"]}
    assert set(points) == {(s, label) for s in SYSTEMS for label in ("qps 4", "c=2")}
    for (system, label), p in points.items():
        want = 4 if label == "qps 4" else 8  # --min-requests 4; fixed concurrency: 4 x c
        assert p["completed"] == p["requests"] == want and p["errors"] == 0, p
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"], p
        assert p["tpot_ms"]["mean"] > 0 and p["itl_ms"]["p50"] > 0, p
        if system.startswith("kvpush"):
            parts = p["breakdown"]
            assert parts["requests"] == want and set(PART_NAMES) <= set(parts), p
            assert parts["prefill_compute"]["p50"] > 0, parts
        else:
            assert "breakdown" not in p
    ratios = {(r["vs"], r["label"]) for r in document["ratios"]}
    assert ratios == {(s, label) for s in SYSTEMS[1:] for label in ("qps 4", "c=2")}

    text = (out / "results.md").read_text()
    assert "### random, 192 input tokens, 4 output" in text
    for system in SYSTEMS:
        assert f"| {system} | qps 4 | 4/0 |" in text
    assert "kvpush TTFT breakdown" in text and "### Ratios" in text
    with Image.open(out / "ttft-random-192.png") as image:
        assert image.format == "PNG" and image.width >= 1000
    assert "kvpush-push" in done.stderr  # progress lines went to stderr
