"""``kvpush bench serve --resume``: the checkpoint saved after every system run, what a resume
refuses (another plan, another commit, uncommitted code, nothing saved), and that a resume runs
only the system runs that are missing and ends with the whole document.

No engine starts here: the systems are stand-ins whose ``start`` fails, so a system that a
resume should have skipped would show up as a failed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush.services.bench import docgen
from kvpush.services.bench.serve import add_arguments, checkpoint, plan, results, run
from kvpush.services.bench.serve.systems import BenchContext, System

SYSTEMS = ("kvpush-push", "vllm-pull")


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--systems", ",".join(SYSTEMS), "--tables", "random:2048", "--qps", "2"]
    argv += ["--concurrency", "1", "--repeats", "2", "--model", str(tmp_path / "model")]
    return parser.parse_args([*argv, "--out-dir", str(tmp_path / "out"), *extra])


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    the_plan = plan.from_args(args)
    ctx = BenchContext(Path(args.model).resolve(), "model", Path(args.out_dir) / "logs")
    return run._meta(args, ctx, the_plan)


def _point(system: str, label: str, repeat: int) -> results.Point:
    ttft = {"mean": 500.0, "p50": 450.0, "p99": 900.0}
    row = {
        "system": system,
        "dataset": "random",
        "input_len": 2048,
        "point": label,
        "label": label,
        "load_kind": "concurrency" if label.startswith("c=") else "qps",
        "load": 1.0 if label.startswith("c=") else 2.0,
        "repeat": repeat,
        "requests": 12,
        "completed": 12,
        "errors": 0,
        "ttft_ms": ttft,
        "tpot_ms": ttft,
        "itl_ms": ttft,
        "e2e_ms": ttft,
        "transfer_check": {"applies": True, "ok": True, "checked": 12},
    }
    return results.point(row)


class Refuses(System):
    """A system that fails to start, naming itself: the record shows it was started."""

    name: ClassVar[str] = "stand-in"

    async def start(self, ctx: BenchContext) -> str:
        raise RuntimeError(f"{self.name} was started")


def _stand_ins() -> dict[str, type[System]]:
    return {name: type(name, (Refuses,), {"name": name}) for name in SYSTEMS}


@pytest.fixture
def committed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This invocation runs committed code (the checkout here may be dirty)."""
    monkeypatch.setattr(docgen, "revision", lambda: "abc1234")


def test_a_checkpoint_is_refused_unless_it_is_the_same_run(
    tmp_path: Path, committed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _args(tmp_path)
    out = Path(args.out_dir)
    with pytest.raises(checkpoint.ResumeError, match="no interrupted run"):
        checkpoint.load(out, _meta(args))
    checkpoint.save(out, checkpoint.Checkpoint(meta=_meta(args), done=[(0, "vllm-pull")]))
    assert checkpoint.load(out, _meta(args)).done == [(0, "vllm-pull")]

    other = _args(tmp_path, "--duration", "5")
    with pytest.raises(checkpoint.ResumeError, match=re.escape("duration_s: 40.0 then, 5.0 now")):
        checkpoint.load(out, _meta(other))
    monkeypatch.setattr(docgen, "revision", lambda: "def5678")
    with pytest.raises(checkpoint.ResumeError, match="kvpush_rev: 'abc1234' then"):
        checkpoint.load(out, _meta(args))
    monkeypatch.setattr(docgen, "revision", lambda: "abc1234-dirty")
    checkpoint.save(out, checkpoint.Checkpoint(meta=_meta(args)))
    with pytest.raises(checkpoint.ResumeError, match="uncommitted code"):
        checkpoint.load(out, _meta(args))
    checkpoint.path_in(out).write_text("{not json")
    with pytest.raises(checkpoint.ResumeError, match="not a bench checkpoint"):
        checkpoint.load(out, _meta(args))


def test_resume_runs_only_the_missing_system_runs(
    tmp_path: Path, committed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "system_classes", _stand_ins)
    args = _args(tmp_path, "--resume")
    out = Path(args.out_dir)
    assert asyncio.run(run.run(args)) == 2  # nothing saved yet: refused, nothing started

    meta = _meta(args)
    saved_points = [
        _point(s, label, r) for s in SYSTEMS for label in ("qps 2", "c=1") for r in (0, 1)
    ]
    saved_points = [p for p in saved_points if (p.repeat, p.system) != (1, "vllm-pull")]
    records = {s: [{"repeat": 0, "ok": True, "start_s": 9.0}] for s in SYSTEMS}
    records["kvpush-push"].append({"repeat": 1, "ok": True, "start_s": 9.5})
    done = [(0, "kvpush-push"), (0, "vllm-pull"), (1, "kvpush-push")]
    rates = {"2048": plan.fixed_rates("2")}
    saved = checkpoint.Checkpoint(meta=meta, done=done, runs=records, rates=rates)
    saved.points = saved_points
    checkpoint.save(out, saved)

    assert asyncio.run(run.run(args)) == 1  # the one missing run was started (and failed)
    document = results.load(out / "results.json")
    assert document.points == saved_points
    push, pull = document.systems["kvpush-push"], document.systems["vllm-pull"]
    assert push["ok"] and [r["repeat"] for r in push["runs"]] == [0, 1]
    assert not pull["ok"] and pull["error"] == "vllm-pull was started"
    assert [(r["repeat"], r["ok"]) for r in pull["runs"]] == [(0, True), (1, False)]
    assert document.meta["date"] == meta["date"] and len(document.meta["resumed"]) == 1
    assert document.rates_by_len == {"2048": [2.0]}
    assert not checkpoint.path_in(out).exists()  # the run completed: nothing left to resume
    assert (out / "results.md").read_text().startswith("<!-- generated: serve (")
