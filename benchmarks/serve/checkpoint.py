"""A ``kvpush bench serve`` run that survives its own interruption (``--resume``).

A whole committed run (five systems, four tables, three repeats) takes hours on a 2-core box,
longer than a machine is sometimes held. After every system of every repeat ``run.py`` saves
what it has (``OUT_DIR/results.partial.json``: the points, each system's run records, the
probed capacities and rates, which (repeat, system) runs are done). ``--resume`` loads that file
and runs only what is missing, with the probed rates it saved, so the document it ends with is
the one an uninterrupted run would have written: same plan, same code, same prompts (their
seeds derive from the point, not from the order of runs). A run started from uncommitted code
(a ``-dirty`` revision) can not be resumed: nothing says the code is still the same. The resumed
document lists every resumption under ``meta["resumed"]``; the partial file is removed when the
run completes.

Threading model: plain functions, called between systems on the bench's asyncio loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from kvpush.benchmarks.serve.plan import Rate
from kvpush.benchmarks.serve.results import Capacity, Point

FILE_NAME = "results.partial.json"
# meta keys that define the run: a resume with any of them different is a different run
SAME_RUN_KEYS = (
    "kvpush_rev",
    "kvpush_env",
    "model",
    "cores",
    "prefill_core",
    "decode_core",
    "vllm",
    "nixl",
    "systems",
    "tables",
    "repeats",
    "qps",
    "fractions",
    "concurrency",
    "duration_s",
    "min_requests",
    "output_len",
    "quick",
    "traced",
    "capacity_given",
    "device",
    "gpu",
    "client",
    "load_format",
    "gpu_memory_utilization",
    "decode_gpu_memory_utilization",
)


class ResumeError(RuntimeError):
    """The saved run can not be continued by this invocation (the message says why)."""


class Checkpoint(msgspec.Struct, kw_only=True):
    meta: dict[str, Any]
    done: list[tuple[int, str]] = msgspec.field(default_factory=list)  # (repeat, system)
    runs: dict[str, list[dict[str, Any]]] = msgspec.field(default_factory=dict)
    capacity: dict[str, Capacity] = msgspec.field(default_factory=dict)
    rates: dict[str, list[Rate]] = msgspec.field(default_factory=dict)  # by input length
    points: list[Point] = msgspec.field(default_factory=list)


def path_in(out_dir: Path) -> Path:
    return out_dir / FILE_NAME


def save(out_dir: Path, checkpoint: Checkpoint) -> None:
    """Write atomically (a kill mid-write leaves the previous checkpoint)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = path_in(out_dir)
    scratch = target.with_suffix(".tmp")
    scratch.write_bytes(msgspec.json.encode(checkpoint))
    os.replace(scratch, target)


def load(out_dir: Path, meta: dict[str, Any]) -> Checkpoint:
    """The saved run in ``out_dir``, if ``meta`` (this invocation's) describes the same run."""
    target = path_in(out_dir)
    if not target.exists():
        raise ResumeError(f"--resume: no interrupted run to resume ({target} does not exist)")
    try:
        saved = msgspec.json.decode(target.read_bytes(), type=Checkpoint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResumeError(f"--resume: {target} is not a bench checkpoint ({exc})") from None
    rev = str(saved.meta.get("kvpush_rev", "-"))
    if rev.endswith("-dirty") or rev == "-":
        raise ResumeError(
            f"--resume: the saved run ran uncommitted code ({rev}); it can not be continued "
            "(nothing says the code is the same): start it again without --resume"
        )
    differs = [k for k in SAME_RUN_KEYS if saved.meta.get(k) != meta.get(k)]
    if differs:
        detail = ", ".join(f"{k}: {saved.meta.get(k)!r} then, {meta.get(k)!r} now" for k in differs)
        raise ResumeError(f"--resume: not the same run ({detail}); start it again without --resume")
    return saved


def remove(out_dir: Path) -> None:
    path_in(out_dir).unlink(missing_ok=True)
