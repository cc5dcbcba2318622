"""One side of ``kvpush bench transport``: a KV pool on one device, its transport, a raw agent.

- CPU (``--device cpu``, the default): the bench model's KV (``kvpush model bench``: 8 layers,
  4 KV heads, head_dim 64, fp32) in vLLM's CPU layout, one numpy
  ``[blocks, kv_heads, 128, 2*head_dim]`` array per layer (one region per layer).
- CUDA (``--device cuda``): the Llama-3-8B shape's KV (32 layers, 8 KV heads, head_dim 128,
  bf16: 16 MiB per 128-token block) in vLLM's FlashAttention layout, one torch
  ``[2, blocks, 128, kv_heads, head_dim]`` tensor per layer on GPU ``--gpu``, registered as two
  regions (K = ``t[0]``, V = ``t[1]``), as kvpush's connector registers a GPU engine's cache.

Besides the transport each side has a raw NIXL agent with one registered buffer (the raw WRITE /
READ comparison), a scratch buffer that sweeps the caches (L3 on CPU, L2 on the GPU) before a
timed op, a local copy (memcpy / device-to-device) and, for the streamed case, ``spin`` (a
layer's compute: a busy loop on CPU, ``torch.cuda._sleep`` on the GPU's stream).

Threading model: a side is used by one thread, except that the streamed case's gate thread
posts through the transport (whose lock serialises it with the poller).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 128
FIRST_REMOTE = 8  # D's blocks start here: an offset, as after other requests
GET_ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}  # cuda_ipc READ on a GPU lane (gpu.md)


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int

    def block_bytes(self) -> int:
        """Bytes of one block id over every layer (K and V)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize * BLOCK_SIZE


def kv_shape(device: str) -> KvShape:
    if device == "cuda":
        return KvShape(layers=32, kv_heads=8, head_dim=128, itemsize=2)  # Llama-3-8B, bf16
    from kvpush.services.models import BENCH

    return KvShape(BENCH.layers, BENCH.kv_heads, BENCH.head_dim, itemsize=4)


def make_setup(device: str, gpu: int, tokens: list[int], error_mode: str, prep: bool) -> dict:
    """What both processes build their side from (plain values: it crosses a spawn)."""
    shape = kv_shape(device)
    most = max(tokens) // BLOCK_SIZE
    return {
        "device": device,
        "gpu": gpu,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_blocks": FIRST_REMOTE + 3 * most,  # push/frag span [8, 8+2n); pull reads after
        "raw_bytes": most * shape.block_bytes(),
        "backend_params": {"ucx_error_handling_mode": error_mode},
        "ucx_env": GET_ZCOPY if device == "cuda" else {},
        "prep_limit": (1 << 18) if prep else 0,
    }


class Side:
    """A transport over a random KV pool on the setup's device, plus the raw agent."""

    def __init__(self, setup: dict[str, Any], name: str, seed: int) -> None:
        from kvpush.connector import (
            AgentConfig,
            CompatInfo,
            KvTransport,
            NixlAgent,
            TransportConfig,
            pool_layout,
        )

        for key, value in setup["ucx_env"].items():  # before the first agent of the process
            os.environ.setdefault(key, value)
        self.cuda = setup["device"] == "cuda"
        self.layers = setup["layers"]
        if self.cuda:
            self._build_cuda(setup, seed)
            dtype, layout = "bfloat16", "gpu-flash-kv"
        else:
            self._build_cpu(setup, seed)
            dtype, layout = "float32", "cpu-kv-concat"
        compat = CompatInfo(model="kvpush-bench", dtype=dtype, block_size=BLOCK_SIZE, layout=layout)
        config = TransportConfig(
            worker_id=name,
            compat=compat,
            backend_params=setup["backend_params"],
            prep_limit=setup["prep_limit"],
        )
        self.transport = KvTransport(config, pool_layout(self.regions))
        self.mem = self.transport.layout.mem_type
        self.raw = NixlAgent(
            AgentConfig(name=f"{name}-raw", backend_params=setup["backend_params"])
        )
        self.raw.register_rows(self.raw_row(0, int(setup["raw_bytes"])), self.mem)
        self.sync()

    def _build_cpu(self, setup: dict[str, Any], seed: int) -> None:
        import numpy as np

        self.np = np
        rng = np.random.default_rng(seed)
        shape = (setup["num_blocks"], setup["kv_heads"], BLOCK_SIZE, 2 * setup["head_dim"])
        self.regions = [[rng.standard_normal(shape, dtype=np.float32)] for _ in range(self.layers)]
        self.buf = np.frombuffer(rng.bytes(setup["raw_bytes"]), dtype=np.uint8).copy()
        self.buf_ptr, self.device_index = self.buf.ctypes.data, 0
        self.dst = np.ones_like(self.buf)  # the memcpy target, faulted in
        self.scratch = np.ones(64 << 20, dtype=np.uint8)  # 2x the CPU box's L3

    def _build_cuda(self, setup: dict[str, Any], seed: int) -> None:
        import numpy as np
        import torch

        self.np, self.torch = np, torch
        device = torch.device("cuda", int(setup["gpu"]))
        torch.cuda.set_device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = (2, setup["num_blocks"], BLOCK_SIZE, setup["kv_heads"], setup["head_dim"])
        pools = [
            torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen)
            for _ in range(self.layers)
        ]
        self.regions = [[kv[0], kv[1]] for kv in pools]
        nbytes = int(setup["raw_bytes"])
        self.buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        self.buf_ptr, self.device_index = self.buf.data_ptr(), device.index or 0
        self.dst = torch.ones_like(self.buf)
        self.scratch = torch.ones(256 << 20, dtype=torch.uint8, device=device)  # > 60 MB L2
        self._cycles_per_s = self._calibrate_sleep()

    def _calibrate_sleep(self) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1e3)

    # ---- device helpers ---------------------------------------------------------------------
    def raw_row(self, offset: int, nbytes: int, base: int | None = None) -> Any:
        start = (self.buf_ptr if base is None else base) + offset
        return self.np.array([[start, nbytes, self.device_index]], self.np.uint64)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def cold(self) -> None:
        """Sweep a buffer larger than the last-level cache, so every timed op starts cold."""
        self.scratch += 1
        self.sync()

    def copy(self, nbytes: int) -> float:
        """Seconds for a local copy of ``nbytes`` (memcpy, or device to device + sync)."""
        t0 = time.perf_counter()
        if self.cuda:
            self.dst[:nbytes].copy_(self.buf[:nbytes])
            self.torch.cuda.synchronize()
        else:
            self.np.copyto(self.dst[:nbytes], self.buf[:nbytes])
        return time.perf_counter() - t0

    def spin(self, seconds: float) -> None:
        """A layer's compute: the GPU's stream sleeps (enqueued: returns at once), or the CPU
        thread busy-waits (CPU kernels run synchronously)."""
        if self.cuda:
            self.torch.cuda._sleep(int(seconds * self._cycles_per_s))
            return
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    def digest(self, runs: list[list[int]]) -> str:
        """sha256 of the blocks ``runs`` in every region (layer order, K before V)."""
        from kvpush.connector import runs_to_ids

        ids = runs_to_ids(runs)
        h = hashlib.sha256()
        for regions in self.regions:
            for region in regions:
                if self.cuda:
                    index = self.torch.as_tensor(ids, device=region.device)
                    picked = region.index_select(0, index).contiguous().view(self.torch.uint8)
                    h.update(picked.cpu().numpy().tobytes())
                else:
                    h.update(region[ids].tobytes())
        return h.hexdigest()

    def close(self) -> None:
        self.transport.close()
        self.raw.close()


def intervals(given: tuple[float, float] | None, cuda: bool) -> dict[str, dict[str, float]]:
    """Each side's Poller intervals: a prefill and a decode worker's (on ``cuda``: a GPU
    host's), or ``given`` (busy, target seconds) for both."""
    from kvpush.connector import worker_intervals

    found = {"prefill": worker_intervals(False, cuda), "decode": worker_intervals(True, cuda)}
    if given:
        busy, target = given
        for side in found.values():
            side.update(busy_interval_s=busy, target_interval_s=target)
    return found


def poll_us(found: dict[str, dict[str, float]]) -> list[float]:
    """P's busy and target, D's busy and target, in us (what a run's JSON records)."""
    keys = ("busy_interval_s", "target_interval_s")
    return [round(found[side][k] * 1e6, 1) for side in ("prefill", "decode") for k in keys]


def decode_side(conn: Any, setup: dict[str, Any]) -> None:
    """The child: serves its pool, expects transfers, reports when each one ended (its Poller
    polls as a kvpush worker's does, and stamps each event when it is seen)."""
    import msgspec

    from kvpush.connector import Poller

    side = Side(setup, "bench-d", seed=2)
    transport = side.transport
    ended: dict[str, tuple[str, float]] = {}

    def seen() -> None:
        now = time.monotonic()
        while not poller.events.empty():
            event = poller.events.get_nowait()
            ended[event.transfer_id] = (event.state.value, now)

    poller = Poller(transport, **setup["intervals"]["decode"], on_events=seen)
    conn.send_bytes(
        msgspec.msgpack.encode(
            [transport.address, transport.epoch, side.raw.metadata(), side.buf_ptr]
        )
    )
    while True:
        side.raw.notifications()  # the raw agent's progress (needed in UCX peer mode)
        if not conn.poll(0.0002):
            continue
        cmd, *rest = msgspec.msgpack.decode(conn.recv_bytes())
        if cmd == "stop":
            break
        if cmd == "expect":
            transport.expect(rest[0], 30.0)
            transport.hurry(rest[0])  # as KvPushing does: P's WRITEs are about to start
            reply: Any = "ok"
        elif cmd == "wait":
            limit = time.monotonic() + 10.0
            while rest[0] not in ended and time.monotonic() < limit:
                time.sleep(0.0001)
            reply = ended.pop(rest[0], ("timeout", 0.0))
        elif cmd == "digest":
            reply = side.digest(rest[0])
        else:
            reply = f"unknown command {cmd}"
        conn.send_bytes(msgspec.msgpack.encode(reply))
    poller.stop()
    side.close()
