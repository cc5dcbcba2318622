"""The soak's stack on this machine, its faults, and the idle measurement of its workers.

``SoakStack`` owns an embedded nats-server, one prefill worker (core 0; its engine sleeps
``layer_delay_ms`` after each layer of a kvpush prompt: a slow prefill keeps race windows open),
one decode worker (core 1, a fixed side-channel port, so a restart comes back at the same
address with a new epoch), both as child processes, an in-process gateway (``gateway_id``
``soak-gw``, in-flight bound ``max_inflight``) and the soak's ``SoakObserver``.

Faults (``inject``): ``kill_prefill`` / ``kill_decode`` (SIGKILL, start again, wait for the new
epoch's first heartbeat), ``stop_decode`` (SIGSTOP past the gateway's lease, then SIGCONT),
``restart_nats``; ``burst`` is the load's (see ``run``).

``settle`` measures every worker idle: it waits, per worker, for consecutive fresh heartbeats
with ``in_flight`` 0 and the same free block count, until that count is every block (or the
timeout; the sample then says what it saw, and ``stable`` False if it never went idle).

Threading model: asyncio on the soak's loop; blocking process and nats-server calls run in
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from kvpush.benchmarks.serve.systems import Process, free_port
from kvpush.benchmarks.soak.accounting import IdleSample
from kvpush.benchmarks.soak.observer import SoakObserver
from kvpush.connector import Bus, BusConfig
from kvpush.services import models
from kvpush.services.gateway import Gateway, GatewayConfig
from kvpush.services.natsd import EmbeddedNats

P, D = "soak-p", "soak-d"
GATEWAY_ID = "soak-gw"
START_TIMEOUT_S = 240.0  # a worker's engine start on a busy 2-core box
STOP_DECODE_S = 5.0  # past the gateway's 3 s lease
REQUEST_TIMEOUT_S = 60.0


class SoakStack:
    def __init__(
        self, model: Path, logs: Path, *, layer_delay_ms: float, max_inflight: int
    ) -> None:
        self.model, self.logs = model, logs
        self.layer_delay_ms = layer_delay_ms
        self.max_inflight = max_inflight
        self.nats = EmbeddedNats()
        self.d_port = free_port()
        self.procs: dict[str, Process] = {}
        self.gateway: Gateway | None = None
        self.observer: SoakObserver | None = None
        self._bus: Bus | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> Process:
        role, core = ("prefill", 0) if worker_id == P else ("decode", 1)
        argv = [sys.executable, "-m", "kvpush.services.cli", role, "--id", worker_id]
        argv += ["--nats-url", self.nats.url, "--model", str(self.model), "--cpus", str(core)]
        env = {}
        if worker_id == P:
            env["KVPUSH_FAULT_LAYER_DELAY_MS"] = str(self.layer_delay_ms)
        else:
            argv += ["--side-channel-port", str(self.d_port)]
        return Process(worker_id, argv, self.logs / f"{worker_id}.log", env).start()

    @property
    def watch(self) -> SoakObserver:
        assert self.observer is not None, "start() first"
        return self.observer

    @property
    def url(self) -> str:
        assert self.gateway is not None, "start() first"
        return self.gateway.url

    async def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.nats.start)
        self._bus = await Bus.connect(BusConfig(url=self.nats.url, name="soak-observer"))
        self.observer = SoakObserver(self._bus, GATEWAY_ID, D)
        await self.observer.start()
        for worker_id in (P, D):
            self.procs[worker_id] = self._worker(worker_id)
        for worker_id in (P, D):
            await self._first_beat(worker_id, None)
        config = GatewayConfig(
            model=str(self.model), nats_url=self.nats.url, port=0, gateway_id=GATEWAY_ID,
            local_threshold=0, max_inflight=self.max_inflight,
            request_timeout_s=REQUEST_TIMEOUT_S, shutdown_grace_s=1.0,
        )  # fmt: skip
        self.gateway = await Gateway.start(config)
        deadline = time.monotonic() + START_TIMEOUT_S
        while 0 in self.gateway.registry.counts().values():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway saw no worker of each role in {START_TIMEOUT_S} s")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Stop everything that started, each part even if an earlier one failed to stop."""
        async with contextlib.AsyncExitStack() as parts:  # runs last-pushed first
            parts.push_async_callback(asyncio.to_thread, self.nats.stop)
            for process in self.procs.values():
                parts.push_async_callback(asyncio.to_thread, process.stop)
            if self._bus is not None:
                parts.push_async_callback(self._bus.close)
            if self.gateway is not None:
                parts.push_async_callback(self.gateway.stop, grace_s=0)

    async def _first_beat(self, worker_id: str, old_epoch: int | None) -> None:
        """Until ``worker_id`` beats with an epoch other than ``old_epoch``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        seq = 0
        while True:
            found = await self.watch.next_beat(worker_id, seq, deadline - time.monotonic())
            if found is None:
                tail = self.procs[worker_id].tail()
                raise RuntimeError(
                    f"{worker_id}: no new heartbeat in {START_TIMEOUT_S:g} s\n{tail}"
                )
            seq, beat = found
            if beat.epoch != old_epoch:
                return

    # ---- faults ----------------------------------------------------------------------------
    async def inject(self, fault: str) -> None:
        if fault in ("kill_prefill", "kill_decode"):
            worker_id = P if fault == "kill_prefill" else D
            old = self.watch.beats[worker_id].epoch
            victim = self.procs[worker_id]
            victim.signal(signal.SIGKILL)
            await asyncio.to_thread(victim.wait)
            await asyncio.sleep(1.0)
            self.procs[worker_id] = self._worker(worker_id)
            await self._first_beat(worker_id, old)
        elif fault == "stop_decode":
            decode = self.procs[D]
            decode.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(STOP_DECODE_S)
            finally:  # never leave D stopped, even when the soak is cancelled here
                decode.signal(signal.SIGCONT)
        elif fault == "restart_nats":
            await asyncio.to_thread(self.nats.restart)
        else:
            raise ValueError(f"not a stack fault: {fault}")

    # ---- idle measurement ------------------------------------------------------------------
    async def settle(self, timeout_s: float) -> list[IdleSample]:
        """Every worker's idle sample (see the module docstring), measured at once."""
        gateway = self.gateway
        assert gateway is not None
        deadline = time.monotonic() + timeout_s
        while gateway.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return list(await asyncio.gather(*(self._settle(w, deadline) for w in (P, D))))

    async def _settle(self, worker_id: str, deadline: float) -> IdleSample:
        started = time.monotonic()
        seq = self.watch.beat_seq.get(worker_id, 0)
        previous = None
        while True:
            found = await self.watch.next_beat(
                worker_id, seq, max(0.0, deadline - time.monotonic()) + 5.0
            )
            if found is None:
                raise RuntimeError(f"{worker_id}: no heartbeat while settling")
            seq, beat = found
            stable = (
                previous is not None
                and beat.in_flight == 0
                and previous.in_flight == 0
                and previous.epoch == beat.epoch
                and previous.free_blocks == beat.free_blocks
            )
            if (stable and beat.free_blocks == beat.total_blocks) or time.monotonic() >= deadline:
                return IdleSample(
                    worker=worker_id,
                    epoch=beat.epoch,
                    free=beat.free_blocks,
                    total=beat.total_blocks,
                    in_flight=beat.in_flight,
                    stable=stable,
                    waited_s=round(time.monotonic() - started, 1),
                )
            previous = beat


def build_model() -> Path:
    """The tiny model (built once into the model cache)."""

    def say(message: str) -> None:
        print(f"[soak] {message}", file=sys.stderr, flush=True)

    return models.build_model(models.TINY, models.default_model_cache_dir() / models.TINY.name, say)
