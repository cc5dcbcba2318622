"""The soak's run: reference answers, clients, the fault cycle, the report.

``Soak.run``: start the stack (``prefill`` + ``decode`` workers on the settings' ``device`` and
``model``: ``engines``); compute a reference (text, token ids and the prompt's ids) for every
prompt of the pool (8 to 40 words, or about ``prompt_tokens`` tokens) with a decode worker alone
(mode local); quiesce once (the baseline idle sample); then for ``minutes`` (less where
``time_budget_s``, the whole run's, leaves less: ``load_until``): ``concurrency`` clients
send requests from the pool (mode: the deployment's default twice as often as each of push,
pull and local; delivery: JSON, streamed to the end with ``stream_share``, streamed and dropped
after the first event with ``abort_share``), and every ``fault_every`` seconds one fault cycle
runs:

1. quiesce: the clients pause (``Gate``), the stack settles, each worker's idle free blocks
   are recorded (a worker about to be killed is measured here, before its kill);
2. the load resumes; 1-3 s later, with requests in flight, the killer (``faults``) plays the
   next fault of its plan: a random worker of a role killed (started again: a new epoch) or
   stopped past its lease (continued), nats-server restarted once per run; ``burst``:
   ``burst_clients`` extra clients for 3 s past the gateway's in-flight bound of
   ``2 x concurrency``. It measures the fault (``measure.FaultRecord``): detection, the victim
   alive and serving again, the throughput's recovery, the migrations;
3. the load runs ``recovery`` seconds more (the end of the fault's window), then quiesce
   again: the interval's leaks.

Every request is judged (``checks.judge``, against the stack's workers per role) in the window
it was sent in (the fault being played out, or ``load``), and counted (``accounting.Tally``);
each token-exact 200's arrival is timed (``measure.Throughput``). At the end the load stops,
the stack settles a last time, and the report (``report.SoakReport``) is printed as markdown,
written as JSON (``--json``) and spliced into a document (``--doc``); ``--report IN`` renders
a written report again without running. Exit 1 when the verdict fails.

Threading model: one asyncio loop (clients, fault cycle, observer, the in-process gateway);
the workers and nats-server are child processes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec

from kvpush.benchmarks import docgen
from kvpush.benchmarks.soak import client, engines
from kvpush.benchmarks.soak.accounting import (
    IdleSample,
    Interval,
    Tally,
    make_interval,
    summarize_leaks,
)
from kvpush.benchmarks.soak.checks import LOAD, Category, Delivery, Judgement, Reference, judge
from kvpush.benchmarks.soak.faults import FaultPlan, Killer, Played
from kvpush.benchmarks.soak.measure import FaultRecord, Throughput, recovery_time, summarize
from kvpush.benchmarks.soak.report import SoakReport, SoakSettings, failures
from kvpush.benchmarks.soak.stack import REQUEST_TIMEOUT_S, SoakStack
from kvpush.services.workers import kv_memory

MODES = (None, None, "push", "pull", "local")  # None: the deployment's default (push)
WORDS = (
    "flitul", "quean", "pyst", "plel", "stroun", "brea",
    "tocko", "gem", "stind", "griond", "chest", "sosio",
)  # fmt: skip
BURST_S = 3.0
BACKOFF_S = 0.5  # a client waits this long after an error
# of a time budget: the last quiesce (a request in flight at the end may hold it up to the
# gateway's request timeout: the H200 soak of 2026-12-06 overran a 45 s reserve) and the stop
FINAL_RESERVE_S = REQUEST_TIMEOUT_S + 30.0


def _say(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


class Gate:
    """Pauses the clients: ``close`` returns once no request is in flight and none can start."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.busy = 0

    async def enter(self) -> None:
        while not self._open.is_set():  # re-checked after waking: close() may have come first
            await self._open.wait()
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1

    async def close(self) -> None:
        self._open.clear()
        while self.busy:
            await asyncio.sleep(0.02)

    def open(self) -> None:
        self._open.set()


class Soak:
    def __init__(self, settings: SoakSettings, log_dir: Path) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)  # prompts and the clients' choices
        self.fault_rng = random.Random(settings.seed + 1)  # the fault sequence
        self.engines = engines.resolve(
            settings.device or engines.CPU, settings.model or "tiny", _say, gpu=settings.gpu or 0,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_gib=settings.kv_cache_gib,
        )  # fmt: skip
        start_timeout_s = settings.start_timeout_s or engines.START_TIMEOUT_S[self.engines.device]
        self.stack = SoakStack(
            self.engines, log_dir, prefill=settings.prefill, decode=settings.decode,
            layer_delay_ms=settings.layer_delay_ms, max_inflight=settings.gateway_max_inflight,
            start_timeout_s=start_timeout_s,
        )  # fmt: skip
        self.killer = Killer(self.stack)
        self.roles = {role.value: ids for role, ids in self.stack.roles.items()}
        self.plan: FaultPlan | None = None  # once the load's length is known (run)
        self.tally = Tally()
        self.throughput = Throughput()
        self.gate = Gate()
        self.window = LOAD
        self.pool: list[tuple[str, Reference]] = []
        self.intervals: list[Interval] = []
        self.faults: Counter[str] = Counter()
        self.records: list[FaultRecord] = []
        self._last: tuple[list[IdleSample], float] = ([], 0.0)  # the last idle sample, when

    # ---- requests --------------------------------------------------------------------------
    async def _references(self) -> None:
        tokens = self.s.prompt_tokens
        tokenizer = engines.load_tokenizer(self.engines.model_dir) if tokens else None
        async with client.session() as http:
            for _ in range(self.s.prompts):
                if tokens:
                    prompt = engines.sized_prompt(self.rng, WORDS, tokens, tokenizer)
                else:
                    words = self.rng.randint(8, 40)
                    prompt = " ".join(self.rng.choice(WORDS) for _ in range(words))
                answer = await self._send(http, prompt, "local", Delivery.JSON)
                seen = await self.stack.watch.observed(answer.request_id, 10.0)
                if answer.status != 200 or answer.error or seen is None or not seen.complete:
                    raise RuntimeError(f"no reference for {prompt!r}: {answer} / {seen}")
                reference = Reference(answer.text, seen.token_ids, seen.prompt_ids)
                self.pool.append((prompt, reference))

    async def _send(
        self, http: aiohttp.ClientSession, prompt: str, mode: str | None, delivery: Delivery
    ) -> client.Answer:
        return await client.send(
            http, self.stack.url, prompt, mode, delivery,
            model=self.engines.served_name, max_tokens=self.s.max_tokens,
        )  # fmt: skip

    def _delivery(self) -> Delivery:
        draw = self.rng.random()
        if draw < self.s.abort_share:
            return Delivery.ABORT
        return Delivery.STREAM if draw < self.s.abort_share + self.s.stream_share else Delivery.JSON

    async def _one(self, http: aiohttp.ClientSession) -> Judgement:
        prompt, reference = self.rng.choice(self.pool)
        mode, delivery = self.rng.choice(MODES), self._delivery()
        await self.gate.enter()
        window = self.window
        try:
            answer = await self._send(http, prompt, mode, delivery)
            answered = time.monotonic()
            seen = None
            if answer.request_id:  # wait for the final chunk of a 200 (an abort's too)
                wait = 2.0 if answer.status == 200 and answer.error is None else 0.0
                seen = await self.stack.watch.observed(answer.request_id, wait)
        finally:
            self.gate.leave()
        s = self.s
        judgement = judge(answer, reference, seen, window, prefill=s.prefill, decode=s.decode)
        self.tally.add(judgement, delivery, window, seen is not None and seen.moves > 0)
        if judgement.category is Category.OK:
            self.throughput.add(answered)
        return judgement

    async def _client(self, until: float, through_faults: bool = True) -> None:
        """Requests one after another until ``until`` (and past it while a fault plays out,
        unless ``through_faults`` is False: a burst's extra clients)."""
        async with client.session() as http:
            while time.monotonic() < until or (through_faults and self.window != LOAD):
                judgement = await self._one(http)
                if judgement.category in (Category.EXPECTED_ERROR, Category.UNEXPECTED):
                    await asyncio.sleep(BACKOFF_S)

    # ---- faults ----------------------------------------------------------------------------
    async def _quiesce(self) -> list[IdleSample]:
        await self.gate.close()
        return await self.stack.settle(self.s.settle_timeout_s)

    async def _inject(self, kind: str, victim: str) -> Played:
        if kind != "burst":
            return await self.killer.play(kind, victim)
        played = Played(kind, victim, time.monotonic())
        end = played.at + BURST_S
        await asyncio.gather(*(self._client(end, False) for _ in range(self.s.burst_clients)))
        return played

    def _record(
        self, played: Played, started: float, in_flight: int, baseline: float, end: float,
        back_s: float | None, moved: dict[str, int],
    ) -> FaultRecord:  # fmt: skip
        now = self.stack.migrations()
        return FaultRecord(
            kind=played.kind,
            victim=played.victim,
            at_s=round(played.at - started, 1),
            in_flight=in_flight,
            window_s=round(end - played.at, 1),
            baseline_rate=round(baseline, 3),
            fault_rate=round(self.throughput.rate(played.at, end), 3),
            detect_s=played.detect_s,
            rejoin_s=played.rejoin_s,
            back_s=back_s,
            recovery_s=recovery_time(
                self.throughput, played.at, end, baseline, self.s.rate_window_s
            ),
            migrations={
                k: n for k in sorted({*now, *moved}) if (n := now.get(k, 0) - moved.get(k, 0))
            },
            profile=self.throughput.profile(played.at, end),
        )

    async def _fault_cycles(self, started: float, until: float) -> None:
        previous, previous_at = self._last
        loaded = time.monotonic()  # the load interval before the next fault began
        # a cycle's fault lands up to 3 s after its quiesce: start one only if it lands, and
        # its recovery load ends, in time (the load goes on while a fault plays out)
        while time.monotonic() + self.s.fault_every_s + 3.0 + self.s.recovery_s < until:
            await asyncio.sleep(self.s.fault_every_s)
            before = await self._quiesce()
            quiesced = time.monotonic()
            at = round(quiesced - started, 1)
            self.intervals.append(make_interval(LOAD, previous_at, 0, previous, before))
            baseline = self.throughput.rate(loaded, quiesced)
            # no cycle can start after this one (it ends 1 s and its recovery after this one)
            cycle = self.s.fault_every_s + 3.0 + self.s.recovery_s
            last = quiesced + 1.0 + self.s.recovery_s + cycle >= until
            assert self.plan is not None, "run() makes the plan"
            kind, victim = self.plan.next(quiesced - started, last)
            self.faults[kind] += 1
            self.window = kind
            self.gate.open()
            await asyncio.sleep(self.fault_rng.uniform(1.0, 3.0))
            assert self.stack.gateway is not None
            in_flight = self.stack.gateway.in_flight
            moved = self.stack.migrations()
            who = f" of {victim}" if victim else ""
            _say(f"fault at {at:.0f} s: {kind}{who} ({in_flight} requests in flight)")
            played = await self._inject(kind, victim)
            await asyncio.sleep(self.s.recovery_s)
            end = time.monotonic()
            back_s = await played.close()
            after = await self._quiesce()
            self.intervals.append(make_interval(kind, at, in_flight, before, after))
            record = self._record(played, started, in_flight, baseline, end, back_s, moved)
            self.records.append(record)
            _say(f"  {record}")
            self.window = LOAD
            self.gate.open()
            loaded = time.monotonic()
            previous, previous_at = after, round(loaded - started, 1)
            self._last = (previous, previous_at)

    # ---- the run ---------------------------------------------------------------------------
    async def _load(self, started: float, until: float) -> str:
        """The clients and the fault cycles until ``until``; why they stopped early ("": they
        did not). A part that fails (a worker or nats-server that failed on its own, a fault
        that could not be injected or recovered from) stops the others: the report says so."""
        parts = [
            asyncio.create_task(self._fault_cycles(started, until), name="faults"),
            *(
                asyncio.create_task(self._client(until), name=f"client-{i}")
                for i in range(self.s.concurrency)
            ),
        ]
        done, pending = await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if (exc := task.exception()) is not None:
                _say(f"{task.get_name()} failed: {exc!r}")
                return f"{task.get_name()}: {exc!r}"[:500]
        return ""

    async def run(self) -> SoakReport:
        date = docgen.stamp()
        begun = time.monotonic()
        await self.stack.start()
        await self._references()
        self._last = (await self.stack.settle(self.s.settle_timeout_s), 0.0)
        started = time.monotonic()
        until = load_until(self.s, begun, started)
        self.plan = FaultPlan(self.s.faults, self.roles, self.fault_rng, until - started)
        _say(f"load + faults for {(until - started) / 60:.1f} min")
        stopped_early = await self._load(started, until)
        if not stopped_early:
            previous, previous_at = self._last
            try:
                final = await self._quiesce()
            except RuntimeError as exc:  # a worker failed on its own at the very end
                stopped_early = f"final quiesce: {exc!r}"[:500]
            else:
                self.intervals.append(make_interval(LOAD, previous_at, 0, previous, final))
        load_s = time.monotonic() - started
        assert self.stack.gateway is not None
        samples = self.stack.gateway.metrics.kv_outcomes.collect()[0].samples
        kv = {
            f"{s.labels['mode']}/{s.labels['outcome']}": int(s.value)
            for s in samples
            if s.name.endswith("_total")
        }
        report = SoakReport(
            settings=self.s,
            wall_s=round(time.monotonic() - begun, 1),
            load_s=round(load_s, 1),
            counts=dict(sorted(self.tally.categories.items())),
            sent=self.tally.sent,
            success_share=round(self.tally.success_share(), 4),
            paths=self.tally.paths(),
            windows=self.tally.windows(),
            errors=self.tally.errors(),
            examples=self.tally.examples,
            faults=dict(sorted(self.faults.items())),
            intervals=self.intervals,
            leaks=summarize_leaks(self.intervals),
            gateway_kv_outcomes=dict(sorted(kv.items())),
            failures=[],
            date=date,
            kvpush_rev=docgen.revision(),
            stopped_early=stopped_early,
            moved=self.tally.moved,
            fault_records=self.records,
            gpu_name=kv_memory.gpu_identity(self.s.gpu) if self.engines.cuda else None,
            fault_summary=summarize(self.records),
        )
        return msgspec.structs.replace(report, failures=failures(report))


def load_until(s: SoakSettings, begun: float, started: float) -> float:
    """When the load phase that starts at ``started`` ends: ``minutes`` later, or earlier where
    the run's ``time_budget_s`` (from ``begun``) must keep ``FINAL_RESERVE_S`` for the end."""
    until = started + s.minutes * 60
    if s.time_budget_s is not None:
        until = max(started, min(until, begun + s.time_budget_s - FINAL_RESERVE_S))
    return until


async def run_soak(settings: SoakSettings, log_dir: Path) -> SoakReport:
    """One soak; the in-process gateway's log (``kvpush.*`` at INFO: its timeouts, migrations
    and membership) goes to ``log_dir/soak-gateway.log`` beside the workers' logs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / "soak-gateway.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kvpush")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    soak = Soak(settings, log_dir)
    try:
        return await soak.run()
    finally:
        try:
            await soak.stack.stop()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            handler.close()
