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
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import add_arguments, checkpoint, plan, results, run
from kvpush.benchmarks.serve.systems import BenchContext, System

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


class Quick(System):
    """A system that starts at once and serves nothing (its points are measured elsewhere)."""

    name: ClassVar[str] = "quick"

    async def start(self, ctx: BenchContext) -> str:
        return "http://127.0.0.1:1"


def test_a_time_budget_stops_between_systems_and_the_resume_finishes(
    tmp_path: Path, committed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--time-budget: no system starts once the run so far plus its longest system would pass
    the budget (not merely once the time spent passed it); the checkpoint holds what ran,
    exit 3, and --resume runs the rest."""
    classes = {name: type(name, (Quick,), {"name": name}) for name in SYSTEMS}
    monkeypatch.setattr(run, "system_classes", lambda: classes)
    now = [0.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: now[0])  # only systems take time

    async def measured(self: Any, system: System, repeat: int, rows: list) -> float:
        now[0] += 100.0
        rows.append(_point(system.name, "qps 2", repeat))
        return 1.0

    monkeypatch.setattr(run.Bench, "run_system", measured)
    args = _args(tmp_path, "--time-budget", "150", "--repeats", "1")
    assert asyncio.run(run.run(args)) == 3  # 100 s spent + 100 s for the next > 150 s
    saved = json.loads(checkpoint.path_in(Path(args.out_dir)).read_text())
    assert saved["done"] == [[0, SYSTEMS[0]]]
    args = _args(tmp_path, "--resume", "--repeats", "1", "--time-budget", "250")
    assert asyncio.run(run.run(args)) == 0
    document = results.load(Path(args.out_dir) / "results.json")
    assert [p.system for p in document.points] == list(SYSTEMS)


def test_parts_of_one_run_join_and_other_runs_do_not(tmp_path: Path, committed: None) -> None:
    """--join: parts with the same plan and given capacity become one document (a system in
    two parts: the last part's points); a part of another plan, or probed rates, is refused."""
    from kvpush.benchmarks.serve import join

    def part(systems: tuple[str, ...], *extra: str) -> results.Document:
        args = _args(tmp_path, "--systems", ",".join(systems), "--qps", "auto", *extra)
        meta = _meta(args)
        points = [_point(s, "0.5x", 0) for s in systems]
        return results.Document(
            meta=meta, points=points, systems={s: {"ok": True} for s in systems}
        )

    given = ("--capacity", "2048=19", "--fractions", "0.5")
    first, second = part(("vllm-pull",), *given), part(("kvpush-push", "vllm-pull"), *given)
    second.points[1].ttft_ms.p50 = 1.0  # the re-run of vllm-pull: its points win
    joined = join.join([first, second])
    assert joined.meta["systems"] == ["kvpush-push", "vllm-pull"]
    assert [(p.system, p.ttft_ms.p50) for p in joined.points] == [
        ("kvpush-push", 450.0),
        ("vllm-pull", 1.0),
    ]
    assert len(joined.meta["parts"]) == 2
    # a one-engine peer on the bench's share, kvpush's engines splitting the GPU: by system
    shared = part(("kvpush-routed",), *given)
    first.meta["gpu_memory_utilization"], shared.meta["gpu_memory_utilization"] = 0.4, 0.25
    joined = join.join([first, shared])
    assert joined.meta["gpu_memory_utilization"] == {"kvpush-routed": 0.25, "vllm-pull": 0.4}
    assert [p["gpu_memory_utilization"] for p in joined.meta["parts"]] == [0.4, 0.25]
    again = part(("vllm-pull",), *given)  # re-ran everything at 0.25: the join says so
    again.meta["gpu_memory_utilization"] = 0.25
    rejoined = join.join([first, again])
    assert rejoined.meta["gpu_memory_utilization"] == 0.25
    assert [p["gpu_memory_utilization"] for p in rejoined.meta["parts"]] == [0.4, 0.25]
    own_d = part(("kvpush-routed",), *given)  # kvpush's D on a share of its own: stated
    own_d.meta["gpu_memory_utilization"], own_d.meta["decode_gpu_memory_utilization"] = 0.25, 0.4
    with_d = join.join([first, own_d])
    assert with_d.meta["decode_gpu_memory_utilization"] == 0.4
    assert [p.get("decode_gpu_memory_utilization") for p in with_d.meta["parts"]] == [None, 0.4]
    assert "decode_gpu_memory_utilization" not in joined.meta
    plain_d = part(("kvpush-push",), *given)  # another kvpush system, its D on the engines'
    plain_d.meta["gpu_memory_utilization"] = 0.25
    with pytest.raises(join.JoinError, match="decode GPU memory shares"):
        join.join([first, own_d, plain_d])
    peer = part(("vllm-serve",), *given)  # vllm-serve at 0.25 against vllm-pull at 0.4
    peer.meta["gpu_memory_utilization"] = 0.25
    with pytest.raises(join.JoinError, match="systems of one kind"):
        join.join([first, peer])
    pair = part(("kvpush-push",), *given)  # kvpush-push at 0.4 against kvpush-routed at 0.25
    pair.meta["gpu_memory_utilization"] = 0.4
    with pytest.raises(join.JoinError, match="systems of one kind"):
        join.join([first, shared, pair])
    with pytest.raises(join.JoinError, match="duration_s"):
        join.join([first, part(("kvpush-push",), *given, "--duration", "5")])
    with pytest.raises(join.JoinError, match="capacity_given"):
        join.join([first, part(("kvpush-push",), "--capacity", "2048=20", "--fractions", "0.5")])
    with pytest.raises(join.JoinError, match="probed their own capacity"):
        join.join([part(("vllm-pull",)), part(("kvpush-push",))])


def test_given_capacity_sets_the_rates_without_a_probe() -> None:
    from kvpush.benchmarks.serve import _capacities

    assert _capacities("2048=19,8192=4.6") == {2048: 19.0, 8192: 4.6}
    with pytest.raises(argparse.ArgumentTypeError):
        _capacities("2048:19")
    rates = plan.auto_rates(19.0, (0.1, 0.5))
    assert [(r.point_id, r.qps) for r in rates] == [("0.1x", 1.9), ("0.5x", 9.5)]


def test_a_part_cut_short_joins_with_its_checkpoint(tmp_path: Path, committed: None) -> None:
    from kvpush.benchmarks.serve import join

    args = _args(tmp_path, "--qps", "auto", "--capacity", "2048=19", "--fractions", "0.5")
    out = Path(args.out_dir)
    records = {"vllm-pull": [{"repeat": 0, "ok": True}], "kvpush-push": []}
    saved = checkpoint.Checkpoint(meta=_meta(args), done=[(0, "vllm-pull")], runs=records)
    saved.points = [_point("vllm-pull", "0.5x", 0)]
    checkpoint.save(out, saved)
    part = join.load_part(checkpoint.path_in(out))
    assert list(part.systems) == ["vllm-pull"] and part.meta["cut_short"]
    assert [p.system for p in join.join([part]).points] == ["vllm-pull"]


def test_capacity_is_refused_where_it_would_not_set_the_rates(tmp_path: Path) -> None:
    from kvpush.services.settings import ConfigError

    with pytest.raises(ConfigError, match="--qps auto only"):
        plan.from_args(_args(tmp_path, "--capacity", "2048=19"))  # _args: --qps 2
    with pytest.raises(ConfigError, match=r"lacks input length\(s\) \[2048\]"):
        plan.from_args(_args(tmp_path, "--qps", "auto", "--capacity", "8192=4"))


def test_parts_with_other_rates_at_a_length_do_not_join(tmp_path: Path, committed: None) -> None:
    from kvpush.benchmarks.serve import join

    args = _args(tmp_path, "--qps", "auto", "--capacity", "2048=19", "--fractions", "0.5")
    first = results.Document(meta=_meta(args), rates_by_len={"2048": [9.5]})
    second = results.Document(meta=_meta(args), rates_by_len={"2048": [9.0]})
    with pytest.raises(join.JoinError, match="other rates at 2048"):
        join.join([first, second])


def test_the_kvpush_settings_of_the_environment_are_recorded_and_shown(
    tmp_path: Path, committed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run records the KVPUSH_* settings its kvpush systems inherit (an A/B such as
    KVPUSH_SERIAL_PREFILL_TOKENS=512 says so in its own JSON), never a secret; a resume with
    others is refused; a join keeps each part's where the parts that ran kvpush differ; the
    routing report shows them."""
    from kvpush.benchmarks.serve import join, report, routing_report

    for name in [n for n in os.environ if n.startswith("KVPUSH_")]:  # the runner's own
        monkeypatch.delenv(name)
    for name in ("NATS_TOKEN", "API_KEYS", "NATS_URL", "NATS_TLS_KEY", "REVISION", "CACHE"):
        monkeypatch.setenv(f"KVPUSH_{name}", "secret-stamp-or-path")
    monkeypatch.setenv("KVPUSH_SERIAL_PREFILL_TOKENS", "512")
    monkeypatch.setenv("KVPUSH_FIRST_TOKEN", "prefill")
    monkeypatch.setenv("KVPUSH_VLLM_ARGS", "--api-key sk-1,--hf-token=hf_1,--tokenizer /t")
    given = ("--qps", "auto", "--capacity", "2048=19", "--fractions", "0.5")
    args = _args(tmp_path, "--systems", "kvpush-routed", *given)
    rule_on = _meta(args)
    assert rule_on["kvpush_env"] == {
        "KVPUSH_FIRST_TOKEN": "prefill",
        "KVPUSH_SERIAL_PREFILL_TOKENS": "512",
        "KVPUSH_VLLM_ARGS": "--api-key ***,--hf-token=***,--tokenizer /t",
    }
    out = Path(args.out_dir)
    checkpoint.save(out, checkpoint.Checkpoint(meta=rule_on))
    monkeypatch.delenv("KVPUSH_SERIAL_PREFILL_TOKENS")
    with pytest.raises(checkpoint.ResumeError, match="kvpush_env"):
        checkpoint.load(out, _meta(args))

    def part(systems: str, env: dict[str, str]) -> results.Document:
        meta = {**_meta(_args(tmp_path, "--systems", systems, *given)), "kvpush_env": env}
        points = [_point(s, "0.5x", 0) for s in systems.split(",")]
        return results.Document(
            meta=meta, points=points, systems={s: {"ok": True} for s in meta["systems"]}
        )

    peer = part("vllm-pull", {})  # ran no kvpush system: its environment does not count
    joined = join.join([peer, part("kvpush-routed", {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"})])
    assert joined.meta["kvpush_env"] == {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"}
    assert "environment: `KVPUSH_SERIAL_PREFILL_TOKENS=512`." in routing_report.body(joined)
    ab_parts = [
        part("kvpush-routed", {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"}),
        part("kvpush-push", {}),
    ]
    ab = join.join([peer, *ab_parts])
    assert "kvpush_env" not in ab.meta
    assert [p.get("kvpush_env") for p in ab.meta["parts"]] == [
        None,
        {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"},
        {},
    ]
    text = routing_report.body(ab)
    assert "in part 2 (kvpush-routed): `KVPUSH_SERIAL_PREFILL_TOKENS=512`." in text
    assert "in part 3 (kvpush-push): no KVPUSH_* setting." in text
    assert "`KVPUSH_SERIAL_PREFILL_TOKENS=512`" in report.render(ab)  # bench report's part lines
    old = part("kvpush-push", {})  # written before the key: not recorded, not a difference
    del old.meta["kvpush_env"]
    with_old = join.join([old, part("kvpush-routed", {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"})])
    assert with_old.meta["kvpush_env"] == {"KVPUSH_SERIAL_PREFILL_TOKENS": "512"}
    mixed = join.join([old, *ab_parts])
    assert mixed.meta["parts"][0]["kvpush_env"] is None
    assert "in part 1 (kvpush-push): not recorded." in routing_report.body(mixed)
