"""What one ``kvpush bench serve`` invocation measures: its tables, load points and seeds.

A *table* is one (dataset, input length), e.g. ``random:2048`` or ``sonnet:2048``: every system
runs every point of it. ``reuse50:1024`` / ``reuse90:1024`` (issue 32, vLLM's client only):
vLLM bench's prefix-repetition dataset with 50% / 90% of each prompt a prefix that other
requests of the point share (``vllm_client.py``); ``chat:1024``: multi-turn conversations
sharing a system prompt, each turn resending the conversation (``chat_workload.py``).
``--tables`` lists them; without it, ``--datasets`` x ``--input-lens`` (their cross product),
and without those the committed set (``DEFAULT_TABLES``).

A *point* has an id that names it independently of what else the run measures: ``0.25x`` (a
Poisson rate at that fraction of the prefill capacity probed at the table's input length),
``qps 1.5`` (a rate given with ``--qps``) or ``c=4`` (fixed concurrency). Its prompts and its
arrival schedule come from ``point_seed(dataset, input_len, point_id, repeat)``, a stable hash
(blake2b, not Python's salted ``hash()``): every system sees the same prompts at a point
whatever subset of systems, tables or points the run has, and each repeat gets prompts of its
own, so one repeat never hits the prefix cache of another (prefix caching is on).

Repeats are interleaved: repeat 1 runs every system, then repeat 2, and so on (drift of the
box over the run then spreads over every system instead of biasing the last ones); the order
of the systems rotates by one each repeat, and every system is started afresh each repeat.

Threading model: pure functions and frozen dataclasses.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass

from kvpush.benchmarks.serve import (
    ALL_SYSTEMS,
    CAPACITY_FRACTIONS,
    CPU_SYSTEMS,
    DEFAULT_TABLES,
    GPU_SYSTEMS,
    VLLM_CLIENT_TABLES,
)
from kvpush.benchmarks.serve.loadgen import LoadPoint
from kvpush.benchmarks.serve.systems import ROUTING_SYSTEMS
from kvpush.services.settings import ConfigError
from kvpush.services.workers.config import resolve_device

REUSE_DATASETS = {"reuse50": 0.5, "reuse90": 0.9}  # name -> prefix share of each prompt
CHAT_DATASET = "chat"  # multi-turn conversations sharing a system prompt (chat_workload.py)
# prefix, reuse*, chat: vLLM's client only
DATASETS = ("random", "sonnet", "prefix", *REUSE_DATASETS, CHAT_DATASET)
CLIENT_DATASETS = {  # the datasets each client can send (vllm_client.py, loadgen.py)
    "vllm": ("random", "prefix", *REUSE_DATASETS, CHAT_DATASET),
    "kvpush": ("random", "sonnet"),
}
CLIENTS = ("kvpush", "vllm")  # who sends the load: loadgen.py, or `vllm bench serve`


@dataclass(frozen=True)
class Table:
    dataset: str
    input_len: int

    @property
    def key(self) -> str:
        return f"{self.dataset}:{self.input_len}"


@dataclass(frozen=True)
class Rate:
    """One Poisson point of a table: its id, rate and (auto rates) capacity fraction."""

    point_id: str
    qps: float
    fraction: float | None = None


@dataclass(frozen=True)
class PointSpec:
    """One measured point of one table in one repeat (the same for every system)."""

    table: Table
    point_id: str
    repeat: int
    load: LoadPoint
    fraction: float | None = None  # of the probed prefill capacity (auto QPS points)

    @property
    def seed(self) -> int:
        return self.load.seed


@dataclass(frozen=True)
class Plan:
    systems: tuple[str, ...]
    tables: tuple[Table, ...]
    qps: str  # "auto" or a comma list of rates
    concurrency: tuple[int, ...]
    repeats: int
    duration_s: float
    min_requests: int
    output_len: int
    fractions: tuple[float, ...] = CAPACITY_FRACTIONS  # of the capacity, for qps "auto"
    capacity: tuple[tuple[int, float], ...] = ()  # (input length, req/s) given, not probed
    client: str = "kvpush"  # who sends each point's load (CLIENTS)

    def system_order(self, repeat: int) -> list[str]:
        """The systems of ``repeat`` (0-based): the list rotated by ``repeat``."""
        k = repeat % len(self.systems) if self.systems else 0
        return [*self.systems[k:], *self.systems[:k]]


def point_seed(dataset: str, input_len: int, point_id: str, repeat: int) -> int:
    """A 63-bit seed from the point's identity and the repeat (stable across runs)."""
    text = f"{dataset}|{input_len}|{point_id}|{repeat}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


def parse_tables(text: str) -> tuple[Table, ...]:
    """``random:512,sonnet:2048`` -> tables (order kept, duplicates dropped)."""
    tables: list[Table] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        dataset, sep, length = item.partition(":")
        if not sep or dataset not in DATASETS or not length.isdigit() or int(length) <= 0:
            raise ValueError(f"table {item!r}: want DATASET:INPUT_LEN, DATASET one of {DATASETS}")
        table = Table(dataset, int(length))
        if table not in tables:
            tables.append(table)
    if not tables:
        raise ValueError("no tables")
    return tuple(tables)


def auto_rates(capacity: float, fractions: tuple[float, ...] = CAPACITY_FRACTIONS) -> list[Rate]:
    return [Rate(f"{f:g}x", round(capacity * f, 2), f) for f in fractions]


def fixed_rates(qps: str) -> list[Rate]:
    return [Rate(f"qps {float(x):g}", float(x)) for x in qps.split(",") if x.strip()]


def points(plan: Plan, table: Table, rates: list[Rate], repeat: int) -> list[PointSpec]:
    """The table's points in measuring order: Poisson rates, then fixed concurrency."""
    found: list[PointSpec] = []
    for rate in rates:
        requests = max(plan.min_requests, round(rate.qps * plan.duration_s))
        seed = point_seed(table.dataset, table.input_len, rate.point_id, repeat)
        load = LoadPoint(
            table.dataset,
            table.input_len,
            requests,
            qps=rate.qps,
            output_len=plan.output_len,
            seed=seed,
        )
        found.append(PointSpec(table, rate.point_id, repeat, load, rate.fraction))
    for c in plan.concurrency:
        point_id = f"c={c}"
        seed = point_seed(table.dataset, table.input_len, point_id, repeat)
        load = LoadPoint(
            table.dataset,
            table.input_len,
            max(plan.min_requests, 4 * c),
            concurrency=c,
            output_len=plan.output_len,
            seed=seed,
        )
        found.append(PointSpec(table, point_id, repeat, load))
    return found


def from_args(args: argparse.Namespace) -> Plan:
    """The plan of a command line (``--quick`` overrides tables, load and repeats)."""
    cuda = resolve_device(getattr(args, "device", "cpu")) == "cuda"
    default = GPU_SYSTEMS if cuda else CPU_SYSTEMS
    text = getattr(args, "systems", None) or ",".join(default)
    systems = tuple(s.strip() for s in text.split(",") if s.strip())
    known = (*ALL_SYSTEMS, *ROUTING_SYSTEMS)
    unknown = sorted(set(systems) - set(known))
    if unknown or not systems:
        raise ConfigError(f"kvpush bench serve: unknown system(s) {unknown}; know {known}")
    try:
        if args.tables and (args.datasets or args.input_lens):
            raise ValueError("give --tables or --datasets/--input-lens, not both")
        if args.tables:
            tables = parse_tables(args.tables)
        elif args.datasets or args.input_lens:
            datasets = [d.strip() for d in (args.datasets or "random").split(",") if d.strip()]
            lens = args.input_lens or [512, 1024, 2048]
            tables = parse_tables(",".join(f"{d}:{n}" for d in datasets for n in lens))
        else:
            vllm = (getattr(args, "client", None) or ("vllm" if cuda else "kvpush")) == "vllm"
            tables = parse_tables(VLLM_CLIENT_TABLES if vllm else DEFAULT_TABLES)
    except ValueError as exc:
        raise ConfigError(f"kvpush bench serve: {exc}") from None
    qps, conc = str(args.qps), tuple(args.concurrency)
    repeats, duration, min_requests = args.repeats, args.duration, args.min_requests
    if args.quick:
        tables, qps, conc = (Table("random", 512),), "1", (2,)
        min_requests, duration = 8, 8.0
        repeats = 1 if repeats is None else repeats
    repeats = 3 if repeats is None else repeats
    if repeats < 1:
        raise ConfigError("kvpush bench serve: --repeats must be at least 1")
    if qps != "auto":
        try:
            fixed_rates(qps)
        except ValueError:
            raise ConfigError(f"kvpush bench serve: --qps {qps!r}: rates or 'auto'") from None
    capacity = getattr(args, "capacity", None) or {}
    if capacity and qps != "auto":
        raise ConfigError("kvpush bench serve: --capacity sets the rates of --qps auto only")
    missing = sorted({t.input_len for t in tables} - set(capacity))
    if capacity and missing:  # those would be probed, each part on its own
        raise ConfigError(f"kvpush bench serve: --capacity lacks input length(s) {missing}")
    fractions = tuple(getattr(args, "fractions", None) or CAPACITY_FRACTIONS)
    if any(f <= 0 for f in fractions):
        raise ConfigError("kvpush bench serve: --fractions must be positive")
    client = getattr(args, "client", None) or ("vllm" if cuda else "kvpush")
    if client not in CLIENTS:
        raise ConfigError(f"kvpush bench serve: --client is one of {CLIENTS}")
    wrong = sorted({t.dataset for t in tables} - set(CLIENT_DATASETS[client]))
    if wrong:
        raise ConfigError(f"kvpush bench serve: --client {client} has no {wrong[0]} dataset")
    return Plan(
        systems,
        tables,
        qps,
        conc,
        repeats,
        duration,
        min_requests,
        args.output_len,
        fractions,
        tuple(sorted(capacity.items())),
        client,
    )
