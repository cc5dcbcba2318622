"""``kvpush bench serve --join``: one results document from runs made in parts.

A sweep too long for one sitting (a lent GPU host gives 10 minutes a command) runs in parts,
each a whole ``kvpush bench serve`` with its own systems and the same plan otherwise: tables,
load points, repeats, and the prefill capacity given with ``--capacity`` (so every part derives
the same rates and, from the point ids, the same prompts). ``join`` checks that the parts agree
on everything that defines the measurement (``checkpoint.SAME_RUN_KEYS`` but the systems, the
revision, the GPU memory share and the KVPUSH_* settings, plus the given capacity), then takes
each system's points from the last part that ran it (a part that re-ran a failed system
replaces the earlier one).
Each part's revision, date, systems and command line are kept under ``meta["parts"]``; parts
of other GPU memory shares (a one-engine peer on the bench's default, kvpush's engines
splitting the GPU: allowed between kvpush's systems and vLLM's, never among one kind) keep
theirs there too, and ``meta["gpu_memory_utilization"]`` is then the share by system; so do
the parts that ran kvpush with other ``KVPUSH_*`` settings (``meta["kvpush_env"]``: an A/B run
by environment). A part cut short (killed at its time limit) joins with the checkpoint it saved
after each system (``load_part``).

Threading model: pure functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from kvpush.benchmarks.serve import ALL_SYSTEMS, checkpoint, results
from kvpush.benchmarks.serve.checkpoint import SAME_RUN_KEYS
from kvpush.benchmarks.serve.results import Document

PART_KEYS = ("date", "kvpush_rev", "systems", "argv")
# what parts may differ in; a system's GPU memory share too (a one-engine peer keeps the
# bench's default while kvpush's engines split the GPU: each part states its own)
DECODE_SHARE = "decode_gpu_memory_utilization"  # kvpush's D engines' own share, if given
ENV = "kvpush_env"  # the KVPUSH_* settings kvpush's systems inherited (an A/B's parts differ)
FREE_KEYS = ("kvpush_rev", "systems", "gpu_memory_utilization", DECODE_SHARE, ENV)


class JoinError(ValueError):
    """The parts are not parts of one run (the message says which key differs)."""


def load_part(path: Path) -> Document:
    """A part's results.json, or the checkpoint of a part cut short (``results.partial.json``:
    the systems it completed)."""
    if not path.name.endswith(".partial.json"):  # results.partial.json, or a copy renamed
        return results.load(path)
    saved = msgspec.json.decode(path.read_bytes(), type=checkpoint.Checkpoint)
    systems: dict[str, Any] = {}
    repeats = int(saved.meta.get("repeats") or 1)
    for name, records in saved.runs.items():
        if records:
            failed = [r for r in records if not r.get("ok")]
            systems[name] = {"ok": not failed, "runs": records}
            if failed:
                systems[name]["error"] = failed[0].get("error", "")
            elif len(records) < repeats:  # the cut came between two of its repeats
                systems[name].update(
                    ok=False, error=f"cut short: {len(records)} of {repeats} repeats ran"
                )
    return Document(
        schema=results.SCHEMA,
        meta={**saved.meta, "cut_short": True},
        systems=systems,
        capacity=saved.capacity,
        rates_by_len={k: [r.qps for r in v] for k, v in saved.rates.items()},
        points=saved.points,
    )


def join(parts: list[Document]) -> Document:
    if not parts:
        raise JoinError("--join: no results given")
    first = parts[0]
    keys = [k for k in SAME_RUN_KEYS if k not in FREE_KEYS]
    for n, part in enumerate(parts[1:], 2):
        differs = [k for k in keys if part.meta.get(k) != first.meta.get(k)]
        if differs:
            detail = ", ".join(
                f"{k}: {first.meta.get(k)!r} in part 1, {part.meta.get(k)!r} in part {n}"
                for k in differs
            )
            raise JoinError(f"--join: part {n} is not a part of the same run ({detail})")
    if len(parts) > 1 and not first.meta.get("capacity_given") and first.meta.get("qps") == "auto":
        raise JoinError(
            "--join: the parts probed their own capacity (rates differ between parts); run them "
            "with the same --capacity"
        )
    owner: dict[str, int] = {}  # system -> index of the last part that ran it
    for index, part in enumerate(parts):
        for name in part.systems or {p.system: None for p in part.points}:
            owner[name] = index
    systems = sorted(owner, key=lambda s: ALL_SYSTEMS.index(s) if s in ALL_SYSTEMS else 99)
    meta = {**first.meta, "systems": systems}
    meta["parts"] = [
        {**{k: part.meta.get(k) for k in PART_KEYS}, "ran": list(part.systems)} for part in parts
    ]
    meta["kvpush_rev"] = ",".join(dict.fromkeys(str(p.meta.get("kvpush_rev")) for p in parts))
    meta["gpu_memory_utilization"] = _shares(parts, owner, systems)
    if len({repr(p.meta.get("gpu_memory_utilization")) for p in parts}) > 1:  # each part's own
        for entry, part in zip(meta["parts"], parts, strict=True):
            entry["gpu_memory_utilization"] = part.meta.get("gpu_memory_utilization")
    meta.pop(DECODE_SHARE, None)  # kvpush's D engines' own share: stated where a part gave one
    if (decode_share := _decode_share(parts, owner, systems)) is not None:
        meta[DECODE_SHARE] = decode_share
    for entry, part in zip(meta["parts"], parts, strict=True):
        if part.meta.get(DECODE_SHARE) is not None:
            entry[DECODE_SHARE] = part.meta[DECODE_SHARE]
    _environments(meta, parts)
    joined = Document(schema=first.schema, meta=meta)
    for name in systems:
        part = parts[owner[name]]
        joined.points += [p for p in part.points if p.system == name]
        if name in part.systems:
            joined.systems[name] = part.systems[name]
    for n, part in enumerate(parts, 1):
        for length, rates in part.rates_by_len.items():
            if joined.rates_by_len.get(length, rates) != rates:
                raise JoinError(f"--join: part {n} measured other rates at {length} tokens")
            joined.rates_by_len[length] = rates
        joined.capacity.update(part.capacity)
    joined.meta.pop("cut_short", None)
    return joined


def _environments(meta: dict[str, Any], parts: list[Document]) -> None:
    """The joined run's ``kvpush_env``: that of the parts that ran a kvpush system when those
    that recorded one agree (a part written before the key has none: not a difference); else
    none for the whole run and each such part's own under ``parts`` (None: not recorded)."""
    ran_kvpush = [
        (entry, part)
        for entry, part in zip(meta["parts"], parts, strict=True)
        if any(name.startswith("kvpush") for name in entry["ran"])
    ]
    recorded = [part.meta[ENV] for _, part in ran_kvpush if part.meta.get(ENV) is not None]
    meta.pop(ENV, None)
    if recorded and all(env == recorded[0] for env in recorded):
        meta[ENV] = recorded[0]
    elif recorded:
        for entry, part in ran_kvpush:
            entry[ENV] = part.meta.get(ENV)


def _decode_share(parts: list[Document], owner: dict[str, int], systems: list[str]) -> Any:
    """kvpush's decode engines' share (--decode-gpu-memory-utilization; None: the engines'
    share): the same for every kvpush system, as ``_shares`` asks of a kind."""
    found = {s: parts[owner[s]].meta.get(DECODE_SHARE) for s in systems if s.startswith("kvpush")}
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{s}: {v}" for s, v in found.items())
        raise JoinError(f"--join: kvpush's systems ran on other decode GPU memory shares ({shown})")
    return next(iter(found.values()), None)


def _shares(parts: list[Document], owner: dict[str, int], systems: list[str]) -> Any:
    """The joined run's GPU memory share: one value when every system ran on the same, else the
    share by system. Systems of one kind (kvpush's, or vLLM's peers) must share one: a pair
    measured against each other (a flag on and off) on other shares is no comparison."""
    shares: dict[str, Any] = {}
    for name in systems:
        share = parts[owner[name]].meta.get("gpu_memory_utilization")
        if isinstance(share, dict):
            raise JoinError(f"--join: {name}'s part is itself a join; join the runs it came from")
        shares[name] = share
    for kvpush in (True, False):
        kind = [s for s in systems if s.startswith("kvpush") is kvpush]
        if len({shares[s] for s in kind}) > 1:
            found = ", ".join(f"{s}: {shares[s]}" for s in kind)
            raise JoinError(f"--join: systems of one kind ran on other GPU memory shares ({found})")
    return shares if len(set(shares.values())) > 1 else shares[systems[0]] if systems else None
