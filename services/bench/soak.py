"""``kvpush bench soak --minutes N``: mixed load with faults injected; nothing may be lost.

Runs its own stack on this machine: an embedded nats-server, an in-process gateway, one prefill
worker (core 0; its engine sleeps ``--layer-delay-ms`` after each layer of a kvpush prompt, a
slow prefill that keeps race windows open) and one decode worker (core 1, a fixed side-channel
port). A pool of prompts (each under one 128-token block, so no prefix cache serves them) gets
reference answers from D alone (mode local) first. Then, for ``--minutes``:

- clients send greedy requests from the pool at ``--concurrency``: the deployment's default
  mode (push; local while no prefill worker is alive) or push, pull or local asked for,
  a share of them streamed and dropped by the client half way (``--abort-share``);
- every ``--fault-every`` seconds one fault, chosen at random: kill P (SIGKILL) and start it
  again, kill D and start it again (same port, new epoch), stop D past its lease (SIGSTOP, 5 s),
  restart nats-server, or a burst of 3x the concurrency at once.

Every answer is checked against its reference: a 200 must be token-exact (``wrong`` counts the
ones that are not; it must be 0), anything else must be an OpenAI error body (errors are counted
by status and message). At the end the load stops, the workers go idle, and each one's free KV
blocks are compared with its count before the run (``leaked``; must be 0). Fallbacks (D computed
the prompt itself) come from the gateway's ``kvpush_gateway_kv_outcomes`` counter.
``--json OUT`` writes the report; it is also printed as markdown.

Threading model: one asyncio loop; the workers and nats-server are child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import WorkerHeartbeat
from kvpush.services import models
from kvpush.services.bench.serve.systems import Process, free_port
from kvpush.services.bus import Bus, BusConfig
from kvpush.services.gateway.app import Gateway, GatewayConfig
from kvpush.services.natsd import EmbeddedNats

P, D = "soak-p", "soak-d"
FAULTS = ("kill_prefill", "kill_decode", "stop_decode", "restart_nats", "burst")
WORDS = [
    "flitul",
    "quean",
    "pyst",
    "plel",
    "stroun",
    "brea",
    "tocko",
    "gem",
    "stind",
    "griond",
    "chest",
    "sosio",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--minutes", type=float, default=10.0, help="how long the load and faults run (10)")
    add("--concurrency", type=int, default=4, help="clients at once (4)")
    add("--fault-every", type=float, default=30.0, help="seconds between faults (30)")
    add("--abort-share", type=float, default=0.1, help="requests the client drops (0.1)")
    add("--layer-delay-ms", type=float, default=100.0, help="P's sleep per layer (100)")
    add("--prompts", type=int, default=40, help="size of the prompt pool (40)")
    add("--seed", type=int, default=0)
    add("--json", metavar="OUT", help="write the report as JSON")
    add("--log-dir", default="/tmp/kvpush-soak", help="workers' logs")


def _say(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.model = models.build_model(
            models.TINY, models.default_model_cache_dir() / models.TINY.name, _say
        )
        self.logs = Path(args.log_dir)
        self.nats = EmbeddedNats()
        self.d_port = free_port()
        self.procs: dict[str, Process] = {}
        self.beats: dict[str, WorkerHeartbeat] = {}
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.gateway: Gateway | None = None
        self.bus: Bus | None = None

    # ---- stack -----------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> Process:
        role, core = ("prefill", 0) if worker_id == P else ("decode", 1)
        argv = [sys.executable, "-m", "kvpush.services.cli", role, "--id", worker_id]
        argv += ["--nats-url", self.nats.url, "--model", str(self.model), "--cpus", str(core)]
        env = {}
        if worker_id == P:
            env["KVPUSH_FAULT_LAYER_DELAY_MS"] = str(self.args.layer_delay_ms)
        else:
            argv += ["--side-channel-port", str(self.d_port)]
        return Process(worker_id, argv, self.logs / f"{worker_id}.log", env).start()

    async def _on_beat(self, subject: str, message: BusMessage) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.beats[message.worker_id] = message

    async def _fresh_beat(self, worker_id: str, want: Any, timeout_s: float = 240.0) -> Any:
        deadline = time.monotonic() + timeout_s
        seen = self.beats.get(worker_id)
        while True:
            beat = self.beats.get(worker_id)
            if beat is not None and beat is not seen and want(beat):
                return beat
            if time.monotonic() > deadline:
                raise RuntimeError(f"{worker_id}: no fitting heartbeat in {timeout_s} s")
            await asyncio.sleep(0.1)

    async def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nats.start()
        self.bus = await Bus.connect(BusConfig(url=self.nats.url, name="soak-observer"))
        await self.bus.subscribe(subjects.heartbeats(), self._on_beat)
        for worker_id in (P, D):
            self.procs[worker_id] = self._worker(worker_id)
        for worker_id in (P, D):
            await self._fresh_beat(worker_id, lambda b: True)
        config = GatewayConfig(
            model=str(self.model), nats_url=self.nats.url, port=0, local_threshold=0,
            request_timeout_s=60.0, shutdown_grace_s=1.0,
        )  # fmt: skip
        self.gateway = await Gateway.start(config)
        while 0 in self.gateway.registry.counts().values():
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop(grace_s=0)
        if self.bus is not None:
            await self.bus.close()
        for process in self.procs.values():
            await asyncio.to_thread(process.stop)
        self.nats.stop()

    # ---- load ------------------------------------------------------------------------------
    async def _send(self, prompt: str, mode: str | None, stream: bool) -> tuple[int, str, str]:
        assert self.gateway is not None
        body = {
            "model": models.TINY.name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "stream": stream,
        }  # fmt: skip
        if mode is not None:
            body["kvpush_mode"] = mode
        timeout = aiohttp.ClientTimeout(total=90)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{self.gateway.url}/v1/completions", json=body) as resp,
        ):
            if stream and resp.status == 200:
                await resp.content.readline()  # the first event, then the client goes away
                return resp.status, "", "aborted by the client"
            answer = await resp.json()
        if resp.status == 200:
            return 200, answer["choices"][0]["text"], ""
        return resp.status, "", str(answer.get("error", {}).get("message", "?"))[:80]

    async def _client(self, pool: list[tuple[str, str]], until: float) -> None:
        while time.monotonic() < until:
            prompt, reference = self.rng.choice(pool)
            mode = self.rng.choice((None, None, "push", "pull", "local"))  # None: the default
            abort = self.rng.random() < self.args.abort_share
            try:
                status, text, error = await self._send(prompt, mode, abort)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.errors[f"client: {type(exc).__name__}"] += 1
                continue
            self.counts["requests"] += 1
            if abort and status == 200:
                self.counts["client_aborts"] += 1
            elif status == 200:
                self.counts["ok"] += 1
                self.counts["wrong"] += text != reference
            else:
                self.errors[f"{status} {error}"] += 1
                await asyncio.sleep(0.5)  # a client backs off after an error

    async def _fault(self, pool: list[tuple[str, str]], until: float) -> None:
        while time.monotonic() + self.args.fault_every < until:
            await asyncio.sleep(self.args.fault_every)
            fault = self.rng.choice(FAULTS)
            self.faults[fault] += 1
            _say(f"fault: {fault}")
            if fault in ("kill_prefill", "kill_decode"):
                worker_id = P if fault == "kill_prefill" else D
                old = self.beats[worker_id].epoch
                self.procs[worker_id].proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                await asyncio.sleep(1.0)
                self.procs[worker_id] = self._worker(worker_id)
                await self._fresh_beat(worker_id, lambda b, old=old: b.epoch != old)
            elif fault == "stop_decode":
                proc = self.procs[D].proc
                assert proc is not None
                proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(5.0)
                proc.send_signal(signal.SIGCONT)
            elif fault == "restart_nats":
                await asyncio.to_thread(self.nats.restart)
            else:
                burst = [self._client(pool, time.monotonic() + 3) for _ in range(8)]
                await asyncio.gather(*burst)

    async def run(self) -> dict[str, Any]:
        await self.start()
        assert self.gateway is not None
        pool = []
        for _ in range(self.args.prompts):
            prompt = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 40)))
            status, text, error = await self._send(prompt, "local", False)
            assert status == 200, error
            pool.append((prompt, text))
        idle = {
            w: (await self._fresh_beat(w, lambda b: b.in_flight == 0)).free_blocks for w in (P, D)
        }
        started = time.monotonic()
        until = started + self.args.minutes * 60
        _say(f"load + faults for {self.args.minutes:g} min")
        clients = [self._client(pool, until) for _ in range(self.args.concurrency)]
        await asyncio.gather(self._fault(pool, until), *clients)
        leaked = {}
        for worker_id, free in idle.items():
            try:
                beat = await self._fresh_beat(
                    worker_id, lambda b, f=free: b.free_blocks == f and b.in_flight == 0, 90
                )
                leaked[worker_id] = free - beat.free_blocks
            except RuntimeError:
                leaked[worker_id] = free - self.beats[worker_id].free_blocks
        metrics = self.gateway.metrics.kv_outcomes.collect()[0].samples
        outcomes = {
            f"{s.labels['mode']}/{s.labels['outcome']}": int(s.value)
            for s in metrics
            if s.name.endswith("_total")
        }
        return {
            "minutes": self.args.minutes,
            "wall_s": round(time.monotonic() - started, 1),
            "concurrency": self.args.concurrency,
            "counts": dict(self.counts),
            "errors": dict(self.errors.most_common()),
            "faults": dict(self.faults),
            "kv_outcomes": outcomes,
            "leaked_blocks": leaked,
        }


def markdown(report: dict[str, Any]) -> str:
    counts = report["counts"]
    lines = [
        f"Soak: {report['minutes']:g} min, {report['concurrency']} clients, "
        f"{counts.get('requests', 0)} requests",
        "",
        "| requests | ok (checked) | wrong tokens | client aborts | errors | leaked blocks |",
        "|---|---|---|---|---|---|",
        f"| {counts.get('requests', 0)} | {counts.get('ok', 0)} | {counts.get('wrong', 0)} "
        f"| {counts.get('client_aborts', 0)} | {sum(report['errors'].values())} "
        f"| {sum(report['leaked_blocks'].values())} |",
        "",
        "Faults injected: " + ", ".join(f"{k} x{v}" for k, v in report["faults"].items()),
        "",
        "KV outcomes (mode/outcome): "
        + ", ".join(f"{k} {v}" for k, v in sorted(report["kv_outcomes"].items())),
        "",
        "Errors by kind:",
        "",
    ]
    lines += [f"- {n} x {kind}" for kind, n in report["errors"].items()] or ["- none"]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    soak = Soak(args)
    try:
        report = await soak.run()
    finally:
        await soak.stop()
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(markdown(report))
    clean = report["counts"].get("wrong", 0) == 0 and not any(report["leaked_blocks"].values())
    return 0 if clean else 1


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))
