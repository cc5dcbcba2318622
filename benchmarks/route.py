"""kvpush bench route: what one routing decision costs the gateway (issue 32's target: 100 us or
less at P50 with 10k cached prefixes and 16 workers).

A ``Router`` in the routed policy over 16 workers (8 prefill, 8 decode: fake heartbeats with
varied loads; P i and D i name one device, as ``kvpush up`` pins a P and a D to each core or
GPU, so each decision also sums the queues of each device: ``device_share``) and the
gateway's real prefix index (``services/gateway/prefix_index.PrefixIndex``, fed
``CacheEvents`` as the workers send them) holding ``--prefixes`` cached prefixes (random
prompts of 256-1024 tokens, spread over the 16 workers). The cost model is warmed with
measurements first, so every decision weighs every candidate (LOCAL on each D, push on each
(P, D) pair; ``route_choice`` ranks those that can be among the cheapest few) rather than the
cold rule's few. For each prompt length and prefix-hit share (the
share of the prompt's leading blocks one D and one P hold), ``route(token_ids)`` is timed
``--repeats`` times, one call at a time (heartbeats re-sent, untimed, every
``BEAT_EVERY`` calls so the loads stay put), then again with the index at its bound (where a
match also reorders the matched blocks: ``PrefixIndex.touches``); so is the prefix look-up alone
(its share of the decision) and the least-loaded policy (no look-up, no scoring) for comparison.
The sweep runs ``--rounds`` times, every case once a round in turn, and each figure is the
median over the rounds: a burst of the host's noise (a shared VM's) lands in one round of one
case instead of deciding its row.

``--out FILE`` writes the results as JSON; ``--report FILE [--doc DOC] [--check]`` prints (or
writes into DOC's generated section) the table of a results file instead of running.

Threading model: the caller's thread only (no loop: the router and index are synchronous).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from kvpush.benchmarks import docgen

TARGET_US: Final = 100.0
LENGTHS: Final = (1024, 2048, 4096, 8192)
HIT_SHARES: Final = (0.0, 0.5, 0.9)
WORKERS: Final = 8  # of each role
BLOCK_SIZE: Final = 16  # vLLM's CUDA default (kvpush's engines: 128, 8x fewer blocks)
BEAT_EVERY: Final = 32
ROUNDS: Final = 5  # the whole sweep, repeated: each figure is the median of its rounds'
VOCAB: Final = 150_000
SECTION: Final = "route-decision"


def report_command(report: str, doc: str) -> str:
    """The command that regenerates ``doc``'s table from ``report`` (its marker names it)."""
    return f"kvpush bench route --report {report} --doc {doc}"


REPORT_COMMAND: Final = report_command(
    "docs/benchmarks/routing/decision.json", "docs/benchmarks/routing/decision.md"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefixes", type=int, default=10_000, help="cached prefixes (10000)")
    parser.add_argument(
        "--repeats", type=_at_least_one, default=2000, help="timed calls per case (2000)"
    )
    parser.add_argument("--seed", type=int, default=32, help="random prompts' seed (32)")
    parser.add_argument(
        "--rounds",
        type=_at_least_one,
        default=ROUNDS,
        help=f"times every case is timed, in turn; each figure is the median over them ({ROUNDS})",
    )
    parser.add_argument(
        "--no-devices",
        action="store_true",
        help="the fake workers name no device (default: P i and D i share device i, as kvpush"
        " up places a P and a D on each core or GPU: the decision also sums each device's queue)",
    )
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--report", metavar="FILE", help="run nothing: the table of FILE")
    parser.add_argument("--doc", metavar="DOC", help="with --report: write it into DOC")
    parser.add_argument("--check", action="store_true", help="with --report --doc: only compare")


class Fleet:
    """The registry, the index and the heartbeats of the 16 fake workers."""

    def __init__(self, rng: random.Random, devices: bool = True) -> None:
        from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
        from kvpush.services.gateway.prefix_index import PrefixIndex
        from kvpush.services.gateway.worker_registry import WorkerRegistry

        self.registry = WorkerRegistry(lease_s=3600.0)
        self.index = PrefixIndex()
        self.seq: dict[str, int] = {}
        self.beats = [
            WorkerHeartbeat(
                worker_id=f"{role.value[0]}{i}",
                role=role,
                epoch=1,
                model="bench",
                side_channel="tcp://127.0.0.1:1",
                in_flight=rng.randrange(0, 8),
                queue_depth=rng.randrange(0, 3),
                free_blocks=rng.randrange(10_000, 100_000),
                total_blocks=200_000,
                sent_at_ms=0,
                sends_first_token=True,
                # P i and D i share a device, as kvpush up pins them (devices: else none)
                gpu=f"bench/cpu{i}" if devices else "",
            )
            for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
            for i in range(WORKERS)
        ]
        self.beat()

    @property
    def ids(self) -> list[str]:
        return [hb.worker_id for hb in self.beats]

    def beat(self) -> None:
        for hb in self.beats:
            self.registry.observe(hb)
            self.index.set_capacity(hb.worker_id, hb.total_blocks)

    def store(self, worker_id: str, token_ids: Sequence[int]) -> None:
        """``worker_id``'s prefix cache now holds ``token_ids``' whole blocks."""
        from kvpush.schemas.messages import CacheEvents
        from kvpush.schemas.prefix import block_hashes

        seq = self.seq.get(worker_id, 0)
        self.seq[worker_id] = seq + 1
        stored = block_hashes(token_ids, BLOCK_SIZE)
        self.index.apply(
            CacheEvents(
                worker_id=worker_id,
                epoch=1,
                seq=seq,
                block_size=BLOCK_SIZE,
                stored=stored,
                cleared=seq == 0,  # the first message: a snapshot's start
                snapshot=seq == 0,
            )
        )


def warm(costs: Any) -> None:
    """Measurements enough for the routed policy to compare modes (every candidate weighed)."""
    from kvpush.schemas.messages import KvPushed, Timing, TransferMode

    ms = 1_000_000
    timing = Timing(
        prefill_received=2 * ms,
        prefill_start=3 * ms,
        prefill_end=53 * ms,
        kv_sent=55 * ms,
        kv_landed=56 * ms,
        first_token=60 * ms,
    )
    for p in range(WORKERS):
        costs.learn(TransferMode.PUSH, f"p{p}", f"d{p}", 2048, timing=timing, published_ns=ms)
    pushed = KvPushed(
        transfer_id="t",
        prefill_id="p0",
        decode_id="d0",
        bytes=2048 * 131_072,
        descriptors=1,
        num_tokens=2048,
        push_ms=30.0,
        timing=timing,
    )
    costs.observe_push(pushed)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _timed(call: Callable[[], object], repeats: int, between: Callable[[], None]) -> list[float]:
    """Microseconds of each of ``repeats`` calls (``between`` runs, untimed, every
    ``BEAT_EVERY``)."""
    gc.collect()
    took: list[float] = []
    for i in range(repeats):
        if i % BEAT_EVERY == 0:
            between()
        start = time.perf_counter_ns()
        call()
        took.append((time.perf_counter_ns() - start) / 1000.0)
    return took


def _at_the_bound(fleet: Fleet, call: Callable[[], object], repeats: int) -> list[float]:
    """``call`` timed with the index at its bound (``max_blocks`` lowered to what it holds), where
    a match also makes the matched blocks the newest (``PrefixIndex.touches``)."""
    index = fleet.index
    bound = index.max_blocks
    index.max_blocks = len(index) + index.pending_drop
    try:
        return _timed(call, repeats, fleet.beat)
    finally:
        index.max_blocks = bound


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def run(
    prefixes: int, repeats: int, seed: int, rounds: int = 1, devices: bool = True
) -> dict[str, Any]:
    if rounds < 1 or repeats < 1:
        raise ValueError(
            f"rounds and repeats must be 1 or more (rounds {rounds}, repeats {repeats})"
        )
    from kvpush.schemas.messages import TransferMode
    from kvpush.services.gateway.routing import Router, RoutingPolicy

    rng = random.Random(seed)
    fleet = Fleet(rng, devices)
    ids = fleet.ids
    started = time.perf_counter()
    for n in range(prefixes):
        length = rng.randrange(256, 1025)
        fleet.store(ids[n % len(ids)], [rng.randrange(VOCAB) for _ in range(length)])
    built_s = time.perf_counter() - started
    routed = Router(fleet.registry, TransferMode.PUSH, 256, prefix=fleet.index)
    least = Router(fleet.registry, TransferMode.PUSH, 256, routing=RoutingPolicy.LEAST_LOADED)
    warm(routed.costs)
    prepared = []  # (prompt, hit share, cached tokens): every case set up before any is timed
    for length in LENGTHS:
        for share in HIT_SHARES:
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
            cached = int(length * share) // BLOCK_SIZE * BLOCK_SIZE
            if cached:
                for holder in ("d3", "p5"):
                    fleet.store(holder, prompt[:cached])
            prepared.append((prompt, share, cached))
    routes = []
    for prompt, _share, cached in prepared:
        found = fleet.index.matched_tokens(prompt, ids)
        assert found.get("d3", 0) == cached, (found, cached)
        fleet.beat()  # the loads as each timed call sees them (a route counts on its workers)
        route = routed.route(prompt)
        assert route.explanation is not None
        routes.append(route.explanation)
    # each round times every case once, in turn: a burst of the host's noise lands on one round
    # of a case, and the median over rounds leaves it out
    by_case: list[dict[str, list[float]]] = [{} for _ in prepared]
    for _ in range(rounds):
        for (prompt, _share, _cached), seen in zip(prepared, by_case, strict=True):
            decide = _timed(lambda p=prompt: routed.route(p), repeats, fleet.beat)
            at_bound = _at_the_bound(fleet, lambda p=prompt: routed.route(p), repeats)
            lookup = _timed(
                lambda p=prompt: fleet.index.matched_tokens(p, ids), repeats, lambda: None
            )
            length = len(prompt)
            plain = _timed(lambda n=length: least.route(n), repeats, fleet.beat)
            for key, value in (
                ("p50_us", statistics.median(decide)),
                ("p99_us", _percentile(decide, 0.99)),
                ("at_bound_p50_us", statistics.median(at_bound)),
                ("lookup_p50_us", statistics.median(lookup)),
                ("least_loaded_p50_us", statistics.median(plain)),
            ):
                seen.setdefault(key, []).append(value)
    cases = []
    for (prompt, share, cached), seen, explanation in zip(prepared, by_case, routes, strict=True):
        cases.append(
            {
                "prompt_tokens": len(prompt),
                "hit_share": share,
                "cached_tokens": cached,
                **{key: round(statistics.median(values), 1) for key, values in seen.items()},
                "p50_us_rounds": [round(value, 1) for value in seen["p50_us"]],
                "choice": explanation.choice.candidate.label,
                "reason": explanation.reason.value,
            }
        )
        print(f"  {len(prompt)} tokens, {share:.0%} hit: {cases[-1]}", flush=True)
    return {
        "meta": {
            "stamp": docgen.stamp(),
            "revision": docgen.revision(),
            "index": "services/gateway/prefix_index.PrefixIndex",
            "prefixes": prefixes,
            "index_entries": len(fleet.index),
            "index_build_s": round(built_s, 2),
            "workers": {"prefill": WORKERS, "decode": WORKERS},
            # heartbeats' gpu: device_share's pass
            "devices": "P i and D i on device i" if devices else "none named",
            "block_size": BLOCK_SIZE,
            "repeats": repeats,
            "rounds": rounds,
            "python": platform.python_version(),
            "machine": _cpu(),
        },
        "target_us": TARGET_US,
        "cases": cases,
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _with_rounds(case: dict[str, Any]) -> str:
    """The decision's P50 (the median over rounds) and, over several rounds, their spread."""
    rounds = case.get("p50_us_rounds", [])
    spread = f" [{min(rounds):.1f}–{max(rounds):.1f}]" if len(rounds) > 1 else ""
    return f"{case['p50_us']:.1f}{spread}"


def table(results: dict[str, Any]) -> str:
    target = results["target_us"]
    rows = [
        (
            c["prompt_tokens"],
            f"{c['hit_share']:.0%}",
            _with_rounds(c),
            f"{c['p99_us']:.1f}",
            f"{c['at_bound_p50_us']:.1f}" if "at_bound_p50_us" in c else "-",
            f"{c['lookup_p50_us']:.1f}",
            f"{c['least_loaded_p50_us']:.1f}",
            c["choice"],
            "met" if c["p50_us"] <= target else "missed",
        )
        for c in results["cases"]
    ]
    head = (
        "prompt tokens",
        "prefix hit",
        "decision P50, us",
        "P99, us",
        "P50 at the index's bound, us",
        "of it: prefix look-up P50, us",
        "least-loaded P50, us",
        "choice",
        f"P50 <= {target:g} us",
    )
    meta = results["meta"]
    note = (
        f"Routed policy, {meta['workers']['prefill']} P + {meta['workers']['decode']} D"
        f"{' (' + meta['devices'] + ')' if meta.get('devices') else ''},"
        f" {meta['index']} holding {meta['prefixes']} cached prefixes"
        f" ({meta['index_entries']} block entries, {meta['block_size']}-token blocks),"
        f" warm cost model (every candidate weighed); {meta['repeats']} timed calls per row"
        f"{_rounds_note(meta.get('rounds', 1))} on"
        f" {meta['machine']} (Python {meta['python']}); run {meta['stamp']} at {meta['revision']}."
        " The look-up hashes the prompt's first block, and when some worker holds it the whole"
        " prompt (it grows with the prompt, from one conversion of its token list); each"
        " holder's depth is a binary search. At the index's bound (max_blocks lowered to what"
        " it holds) a match also makes the matched blocks that worker's newest."
    )
    return docgen.table(head, rows) + "\n\n" + note


def _rounds_note(rounds: int) -> str:
    if rounds <= 1:
        return ""
    return (
        f" in each of {rounds} rounds (every case timed once a round, in turn; each figure is the"
        " median over the rounds, [min–max] of the decision's P50)"
    )


def main(args: argparse.Namespace) -> int:
    if args.report:
        command = report_command(args.report, args.doc or "")
        return docgen.publish_report(args, table, SECTION, command)
    print(f"kvpush bench route: {args.prefixes} prefixes, {args.repeats} calls a case", flush=True)
    results = run(args.prefixes, args.repeats, args.seed, args.rounds, not args.no_devices)
    text = json.dumps(results, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(table(results))
    return 0
