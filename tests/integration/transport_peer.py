"""The other process of the transport tests: a ``KvTransport`` over random numpy pools, driven
through a multiprocessing pipe. The parent owns its lifetime (``PeerProcess.close`` kills it);
the child also exits when the pipe closes, so it cannot outlive the test.

Threading model: the child is one thread that alternates between ``transport.poll()`` and
commands from the pipe; events from ``poll()`` are kept until the parent asks for them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.connector.layout import PoolLayout, pool_layout
from kvpush.connector.peering import CompatInfo
from kvpush.connector.transfer import TransferEvent
from kvpush.connector.transport import KvTransport, TransportConfig


@dataclass(frozen=True)
class PoolSpec:
    seed: int
    layers: int = 3
    regions: int = 2  # 2: split K/V tensors per layer (GPU-like); 1: vLLM CPU layout
    num_blocks: int = 16
    block_bytes: int = 8192
    dtype: str = "float32"
    model: str = "test-model"
    block_size: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    def compat(self) -> CompatInfo:
        return CompatInfo(
            model=self.model, dtype=self.dtype, block_size=self.block_size, layout="test"
        )


def make_pools(spec: PoolSpec) -> list[list[np.ndarray]]:
    """Deterministic random pools: ``pools[layer][region]`` shaped [num_blocks, block_bytes]."""
    rng = np.random.default_rng(spec.seed)
    return [
        [
            rng.integers(0, 256, size=(spec.num_blocks, spec.block_bytes), dtype=np.uint8)
            for _ in range(spec.regions)
        ]
        for _ in range(spec.layers)
    ]


def make_transport(
    spec: PoolSpec, name: str, **overrides: Any
) -> tuple[KvTransport, list[list[np.ndarray]], PoolLayout]:
    pools = make_pools(spec)
    layout = pool_layout(pools)
    config = TransportConfig(worker_id=name, compat=spec.compat(), **{**spec.extra, **overrides})
    return KvTransport(config, layout), pools, layout


def _serve(conn: Any, spec: PoolSpec, name: str) -> None:
    transport, pools, _ = make_transport(spec, name)
    conn.send((transport.address, transport.epoch, os.getpid()))
    events: list[TransferEvent] = []
    while True:
        events.extend(transport.poll())
        if not conn.poll(0.0005):
            continue
        try:
            cmd, *args = conn.recv()
        except EOFError:  # parent is gone
            break
        if cmd == "stop":
            break
        conn.send(_command(transport, pools, events, cmd, args))
    transport.close()


def _command(
    transport: KvTransport,
    pools: list[list[np.ndarray]],
    events: list[TransferEvent],
    cmd: str,
    args: list[Any],
) -> Any:
    try:
        if cmd == "expect":
            return transport.expect(*args)
        if cmd == "events":
            out = list(events)
            events.clear()
            return out
        if cmd == "blocks":  # (layer, region, ids) -> copy of those blocks
            layer, region, ids = args
            return pools[layer][region][np.asarray(ids)].copy()
        if cmd == "push":  # (tid, address, remote_runs, local_runs, groups, timeout, epoch)
            tid, address, remote_runs, local_runs, groups, timeout, epoch = args
            transport.start_push(tid, address, remote_runs, local_runs, timeout, epoch)
            for group in groups:
                transport.push_layers(tid, group)
            transport.finish(tid)
            return transport.state(tid)
        if cmd == "abort":
            return transport.abort(*args)
        if cmd == "live_handles":
            return transport.live_handles
        raise ValueError(f"unknown command {cmd}")
    except Exception as exc:
        return exc


class PeerProcess:
    """Parent-side handle: start, call with a timeout, wait for events, kill."""

    def __init__(self, spec: PoolSpec, name: str = "peer", timeout_s: float = 20.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec, name), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self.buffered: list[TransferEvent] = []
        if not self.conn.poll(timeout_s):
            self.close()
            raise TimeoutError("peer process did not start")
        self.address, self.epoch, self.pid = self.conn.recv()

    def call(self, *cmd: Any, timeout_s: float = 10.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {cmd[0]}")
        result = self.conn.recv()
        if isinstance(result, Exception):
            raise result
        return result

    def wait_events(self, tid: str, count: int = 1, timeout_s: float = 10.0) -> list[TransferEvent]:
        """Events of transfer ``tid`` (others stay buffered for their own wait)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.buffered.extend(self.call("events"))
            mine = [e for e in self.buffered if e.transfer_id == tid]
            if len(mine) >= count or time.monotonic() >= deadline:
                self.buffered = [e for e in self.buffered if e.transfer_id != tid]
                return mine
            time.sleep(0.005)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.proc.join(3)
        except (BrokenPipeError, OSError):
            pass
        self.kill()
        self.conn.close()
