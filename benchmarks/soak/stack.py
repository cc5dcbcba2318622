"""The soak's stack on this machine, its faults, and the idle measurement of its workers.

``SoakStack`` owns an embedded nats-server, ``prefill`` prefill workers (``soak-p0``,
``soak-p1``, ...; each engine sleeps ``layer_delay_ms`` after each layer of a kvpush prompt: a
slow prefill keeps race windows open; 0: not at all) and ``decode`` decode workers
(``soak-d0``, ...; each on a fixed side-channel port, so a restart comes back at the same
address with a new epoch), as child processes running their engines as ``engines`` says (the
device, the model, the engine flags: ``engines.Engines``), pinned to the box's cores
(``engines.core_sets``: on cpu one core each in turn, P then D: with one of each on two cores,
P on core 0 and D on core 1; on cuda an even share each) and started in
``Engines.start_batches`` (cuda: the first alone, then the others), each given
``start_timeout_s`` to beat; an in-process gateway (``gateway_id`` ``soak-gw``, in-flight bound
``max_inflight``) and the soak's ``SoakObserver``.

Faults (``faults.Killer`` plays them): ``kill`` (SIGKILL to the worker's process group, its
engine-core process included; every process of the group gone, so a GPU engine's memory is
free again; start again, wait for the new epoch's first heartbeat), ``pause`` (SIGSTOP for a
while, then SIGCONT), ``restart_nats``; ``burst`` is the load's (see ``run``).
``gateway_epoch`` is the gateway's view of a worker (None: gone).

``settle`` measures every worker idle: it waits, per worker, for consecutive fresh heartbeats
with ``in_flight`` 0 and the same free block count, until that count is every block (or the
timeout; the sample then says what it saw, and ``stable`` False if it never went idle).

Threading model: asyncio on the soak's loop; blocking process and nats-server calls run in
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from kvpush.benchmarks.serve.systems import Process, free_port
from kvpush.benchmarks.soak.accounting import IdleSample
from kvpush.benchmarks.soak.engines import Engines, core_sets
from kvpush.benchmarks.soak.observer import SoakObserver
from kvpush.connector import Bus, BusConfig
from kvpush.schemas.messages import WorkerRole
from kvpush.services.gateway import Gateway, GatewayConfig
from kvpush.services.membership import DEFAULT_LEASE_S
from kvpush.services.natsd import EmbeddedNats

GATEWAY_ID = "soak-gw"
REQUEST_TIMEOUT_S = 60.0
RESTART_PAUSE_S = 1.0  # between a killed worker's exit and its start again
GROUP_GONE_S = 30.0  # a killed worker's other processes (its engine core) exit within this


class SoakStack:
    def __init__(
        self,
        engines: Engines,
        logs: Path,
        *,
        prefill: int,
        decode: int,
        layer_delay_ms: float,
        max_inflight: int,
        start_timeout_s: float,
    ) -> None:
        self.engines, self.logs = engines, logs
        self.model = engines.model_dir
        self.layer_delay_ms = layer_delay_ms
        self.max_inflight = max_inflight
        self.start_timeout_s = start_timeout_s
        self.nats = EmbeddedNats()
        self.roles: dict[WorkerRole, list[str]] = {
            WorkerRole.PREFILL: [f"soak-p{i}" for i in range(prefill)],
            WorkerRole.DECODE: [f"soak-d{i}" for i in range(decode)],
        }
        self.cores = core_sets(sorted(os.sched_getaffinity(0)), self.workers, engines.device)
        self.ports = {w: free_port() for w in self.roles[WorkerRole.DECODE]}
        # every incarnation of a worker starts with this environment: the in-process gateway's
        # vLLM imports change os.environ (LD_PRELOAD, thread settings, ...), and a worker
        # started again with those ran several times slower than its first incarnation
        self.environ = dict(os.environ)
        self.procs: dict[str, Process] = {}
        self.gateway: Gateway | None = None
        self.observer: SoakObserver | None = None
        self._bus: Bus | None = None

    @property
    def workers(self) -> list[str]:
        """Every worker id, prefill first."""
        return [*self.roles[WorkerRole.PREFILL], *self.roles[WorkerRole.DECODE]]

    def role_of(self, worker_id: str) -> WorkerRole:
        return next(role for role, ids in self.roles.items() if worker_id in ids)

    # ---- lifecycle -------------------------------------------------------------------------
    def worker_argv(self, worker_id: str, nats_url: str) -> tuple[list[str], dict[str, str]]:
        """The command line of ``worker_id`` and the variables added to its environment."""
        role = self.role_of(worker_id)
        argv = [sys.executable, "-m", "kvpush.services.cli", role.value, "--id", worker_id]
        argv += ["--nats-url", nats_url, "--model", str(self.model)]
        argv += ["--cpus", self.cores[worker_id], *self.engines.flags()]
        env = {}
        if role is WorkerRole.PREFILL:
            if self.layer_delay_ms:
                env["KVPUSH_FAULT_LAYER_DELAY_MS"] = str(self.layer_delay_ms)
        else:
            argv += ["--side-channel-port", str(self.ports[worker_id])]
        return argv, env

    def _worker(self, worker_id: str) -> Process:
        argv, env = self.worker_argv(worker_id, self.nats.url)
        process = Process(worker_id, argv, self.logs / f"{worker_id}.log")
        process.env = {**self.environ, **env}
        return process.start()

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
        self.observer = SoakObserver(self._bus, GATEWAY_ID)
        await self.observer.start()
        for batch in self.engines.start_batches(self.workers):
            for worker_id in batch:
                self.procs[worker_id] = self._worker(worker_id)
            for worker_id in batch:
                await self._first_beat(worker_id, None)
        config = GatewayConfig(
            model=str(self.model), nats_url=self.nats.url, port=0, gateway_id=GATEWAY_ID,
            local_threshold=0, max_inflight=self.max_inflight,
            request_timeout_s=REQUEST_TIMEOUT_S, shutdown_grace_s=1.0,
        )  # fmt: skip
        self.gateway = await Gateway.start(config)
        deadline = time.monotonic() + self.start_timeout_s
        while any(self.gateway_epoch(w) is None for w in self.workers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway saw not every worker in {self.start_timeout_s} s")
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
        deadline = time.monotonic() + self.start_timeout_s
        seq = 0
        while True:
            found = await self.watch.next_beat(worker_id, seq, deadline - time.monotonic())
            if found is None:
                tail = self.procs[worker_id].tail()
                raise RuntimeError(
                    f"{worker_id}: no new heartbeat in {self.start_timeout_s:g} s\n{tail}"
                )
            seq, beat = found
            if beat.epoch != old_epoch:
                return

    # ---- faults ----------------------------------------------------------------------------
    def gateway_epoch(self, worker_id: str) -> int | None:
        """The epoch the gateway's membership counts ``worker_id`` alive with; None: gone."""
        assert self.gateway is not None, "start() first"
        return self.gateway.registry.epoch(self.role_of(worker_id), worker_id)

    def lease_s(self, worker_id: str) -> float:
        """The lease ``worker_id``'s heartbeats state."""
        beat = self.watch.beats.get(worker_id)
        return beat.lease_ms / 1000 if beat is not None and beat.lease_ms else DEFAULT_LEASE_S

    def migrations(self) -> dict[str, int]:
        """The gateway's ``kvpush_gateway_migrations_total`` by ``lost`` label."""
        assert self.gateway is not None, "start() first"
        samples = self.gateway.metrics.migrations.collect()[0].samples
        return {s.labels["lost"]: int(s.value) for s in samples if s.name.endswith("_total")}

    async def kill(self, worker_id: str) -> None:
        """SIGKILL, start again, until the new epoch's first heartbeat."""
        old = self.watch.beats[worker_id].epoch
        victim = self.procs[worker_id]
        group = victim.proc.pid if victim.proc is not None else None
        victim.signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait)
        if group is not None:
            await group_gone(group, GROUP_GONE_S)
        await asyncio.sleep(RESTART_PAUSE_S)
        self.procs[worker_id] = self._worker(worker_id)
        await self._first_beat(worker_id, old)

    async def pause(self, worker_id: str, seconds: float) -> None:
        """SIGSTOP for ``seconds``, then SIGCONT."""
        victim = self.procs[worker_id]
        victim.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:  # never leave a worker stopped, even when the soak is cancelled here
            victim.signal(signal.SIGCONT)

    async def restart_nats(self) -> None:
        await asyncio.to_thread(self.nats.restart)

    # ---- idle measurement ------------------------------------------------------------------
    async def settle(self, timeout_s: float) -> list[IdleSample]:
        """Every worker's idle sample (see the module docstring), measured at once."""
        gateway = self.gateway
        assert gateway is not None
        deadline = time.monotonic() + timeout_s
        while gateway.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return list(await asyncio.gather(*(self._settle(w, deadline) for w in self.workers)))

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


def group_members(group: int, proc: Path = Path("/proc")) -> list[int]:
    """The live processes of process group ``group`` (zombies, already dead, left out)."""
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


async def group_gone(group: int, timeout_s: float) -> bool:
    """Until no process of ``group`` is alive (SIGKILLed ones exit at once; a GPU engine's
    memory is free once its process is gone), at most ``timeout_s``; whether it is gone."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(group_members, group):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True
