"""``kvpush bench checksum``: P's and D's passes over a pool on the CPU, the table and its
verdicts, and the committed runs' docs (what their JSON generates)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpush.benchmarks import checksum, docgen

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "checksum"


def _args(**given: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    checksum.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(device="cpu", layers=3, kv_heads=2, head_dim=8, repeats=3, **given)
    return args


def test_a_run_times_both_passes_per_length_and_shares_a_given_ttft() -> None:
    results = checksum.run(_args(tokens="64,128", ttft="128=0.000001"))
    short, long = results["cases"]
    assert (short["prompt_tokens"], long["prompt_tokens"]) == (64, 128)
    assert short["kv_bytes"] == 3 * 4 * 16 * 2 * 16 * 2  # layers, blocks, tokens, heads, 2*dim
    assert long["kv_bytes"] == 2 * short["kv_bytes"]
    for case in (short, long):
        assert 0 < case["p_pass"]["p50_ms"] <= case["p_pass"]["p99_ms"]
        assert case["both"]["p50_ms"] > 0 and case["p_layers_host_us"] >= 0
    assert "share" not in short and long["share"] > 1  # a TTFT of 1 ns: far over the target
    assert results["meta"]["kernel"] == "torch" and results["meta"]["shape"]["layers"] == 3
    text = checksum.table(results)
    assert "| 64 | " in text and text.splitlines()[2].endswith("| - | - |")  # no TTFT: no verdict
    assert text.splitlines()[3].endswith("| missed |")


def test_a_share_within_two_percent_is_met() -> None:
    case = {
        "prompt_tokens": 2048,
        "kv_bytes": 256 * 2**20,
        "p_layers_host_us": 1.0,
        "p_pass": {"p50_ms": 0.1, "p99_ms": 0.2},
        "d_pass": {"p50_ms": 0.1, "p99_ms": 0.3},
        "both": {"p50_ms": 0.2, "p99_ms": 0.5},
        "ttft_ms": 10.0,
        "share": 0.02,
    }
    results = {
        "meta": {
            "device": "cuda",
            "device_name": "GPU",
            "kernel": "triton",
            "shape": {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16},
            "repeats": 1,
            "torch": "t",
            "python": "p",
            "stamp": "s",
            "revision": "r",
        },
        "target_share": checksum.TARGET_SHARE,
        "cases": [case, {**case, "share": 0.0201}],
    }
    lines = checksum.table(results).splitlines()
    assert lines[2].endswith("| 2.00% of 10 ms | met |")
    assert lines[3].endswith("| 2.01% of 10 ms | missed |")


@pytest.mark.parametrize("run", sorted(p.stem for p in DOCS.glob("*.json")) or ["(none)"])
def test_each_committed_run_s_doc_is_what_its_json_generates(run: str) -> None:
    if run == "(none)":
        pytest.skip("no checksum run committed (docs/benchmarks/checksum/)")
    data, doc = DOCS / f"{run}.json", DOCS / f"{run}.md"
    body = checksum.table(json.loads(data.read_text()))
    command = f"kvpush bench checksum --report docs/benchmarks/checksum/{run}.json --doc {doc}"
    assert docgen.section(doc.read_text(), checksum.SECTION) == body
    assert command.split(" --doc ")[0] in doc.read_text()
