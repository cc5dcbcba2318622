"""GPU transport benchmark: kvpush push/pull of VRAM KV between two processes vs raw NIXL and a
device-to-device copy of the same bytes. Run by hand on a CUDA machine; CI never runs it.

    python -m tests.gpu.gpu_transport --json OUT.json --log OUT.log

Without CUDA (or without torch / nixl) it prints ``SKIP: ...`` and exits 0. ``--cpu`` runs the
same flow on host memory (DRAM): a dry run of the script's logic, not a GPU result.

KV of the bench model (8 layers, 4 KV heads, head_dim 64, block size 128) in bf16 and vLLM's GPU
(FlashAttention) layout: per layer one ``[2, num_blocks, 128, 4, 64]`` tensor, registered as two
regions per layer (K = ``t[0]``, V = ``t[1]``), so one block is 64 KiB per region and 1 MiB
across the pool. 2048 tokens = 16 MiB, 8192 tokens = 64 MiB.

Each UCX setting ("variant") runs in fresh processes, since UCX reads its environment once: this
process is the orchestrator; per variant it starts a worker (the prefill side, ``--worker``),
which spawns the decode side; both allocate their pools on the same GPU (``--gpu-p`` /
``--gpu-d`` pick others where there are several). Per case, after verified runs (sha256 of the
destination blocks == of the source blocks, for every op), the median over ``--repeats`` of
(each op starts with L2 flushed by writing a 256 MiB scratch buffer):

  push       one WRITE per layer (push_layers after each layer) + finish, P blocks [0, n) into
             D blocks [8, 8+n): 2 descriptors (K, V) per layer; from the first post until
             poll() reports DONE (all WRITEs done, completion notice sent)
  push_1req  the same bytes in one request, timed from start_push
  push_frag  one request per layer into D blocks in 2-block runs (n descriptors per layer)
  pull       one READ of all layers (start_pull + notice to the owner)
  raw        one single-descriptor NIXL WRITE of the same bytes between two plain registered
             VRAM buffers (the request is created before the clock starts: transfer() -> DONE);
             raw_layered: 8 such WRITEs (one per layer-sized chunk) posted together;
             raw_read: one single-descriptor READ
  d2d        torch ``dst.copy_(src)`` of the same bytes inside the prefill process, then
             ``cuda.synchronize()`` (wall clock, like every other column); d2d_regions: the 16
             per-region block-range copies push's descriptors describe; d2d_event_ms: the
             contiguous copy timed by CUDA events (device time only)

plus a size sweep (raw WRITE / READ vs d2d at 1 MiB .. 1 GiB) to split fixed cost from
bandwidth. GB/s are 1e9 bytes (moved once, one-way) per second.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 128
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 64  # kvpush model "bench"
FIRST_REMOTE = 8  # D's blocks start here: an offset, as after other requests
SCRATCH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
REPO = Path(__file__).resolve().parents[2]

# name -> (UCX environment, decode-side poll interval in s, what it tests)
VARIANTS: dict[str, tuple[dict[str, str], float, str]] = {
    "default": ({}, 0.0, "UCX defaults, ucx_error_handling_mode=none, D busy-polls"),
    "get_zcopy": (
        {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"},
        0.0,
        "cuda_ipc get_zcopy forced on (auto disables it when NVML reports no NVLink)",
    ),
    "d_poll_1ms": ({}, 0.001, "as default, but D polls every 1 ms: does completion need D?"),
    "no_tcp": (
        {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
        0.0,
        "UCX_TLS without tcp: READ cannot fall back to rma_am over tcp",
    ),
}


# ---- imports and environment ----------------------------------------------------------------


def ensure_kvpush_importable() -> str | None:
    """Make ``import kvpush.connector`` work from a plain checkout: a temp dir holding
    ``kvpush/{connector,schemas,services}`` symlinks goes on sys.path and PYTHONPATH."""
    try:
        import kvpush.connector

        return None
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="kvpush-path-"))
    (root / "kvpush").mkdir()
    for name in ("connector", "schemas", "services"):
        (root / "kvpush" / name).symlink_to(REPO / name)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
    )
    import kvpush.connector  # noqa: F401

    return str(root)


def skip_reason(cpu: bool) -> str | None:
    import importlib.util

    for module in ("torch", "nixl", "msgspec", "zmq", "numpy"):
        if importlib.util.find_spec(module) is None:
            return f"python package {module} is not installed"
    if cpu:
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def ucx_version() -> str:
    import ctypes
    import importlib.util

    for pkg in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        base = Path(next(iter(spec.submodule_search_locations))).parent
        for lib in glob.glob(str(base / f"{pkg}.libs" / "libucp*.so*")):
            try:
                fn = ctypes.CDLL(lib).ucp_get_version_string
                fn.restype = ctypes.c_char_p
                return f"{fn().decode()} ({pkg})"
            except OSError:
                continue
    return "unknown"


def environment(cpu: bool) -> dict[str, Any]:
    import importlib.metadata as md
    import platform

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "ucx": ucx_version(),
        "cpus": os.cpu_count(),
    }
    for dist in ("nixl", "nixl-cu13", "nixl-cu12", "msgspec", "pyzmq", "numpy"):
        with contextlib.suppress(md.PackageNotFoundError):
            info[dist] = md.version(dist)
    if not cpu:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            info["nvidia_smi"] = out.stdout.strip()
    return info


# ---- both sides -----------------------------------------------------------------------------


class Dev:
    """Where the pools live: one CUDA device (or host memory for ``--cpu`` dry runs)."""

    def __init__(self, cpu: bool, index: int) -> None:
        import torch

        self.torch = torch
        self.cuda = not cpu
        self.device = torch.device("cuda", index) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def generator(self, seed: int) -> Any:
        return self.torch.Generator(device=self.device).manual_seed(seed)

    def random_bytes(self, nbytes: int, seed: int) -> Any:
        t = self.torch
        return t.randint(
            0, 256, (nbytes,), dtype=t.uint8, device=self.device, generator=self.generator(seed)
        )


def make_side(setup: dict[str, Any], name: str, seed: int) -> dict[str, Any]:
    """A KvTransport over a random bf16 K/V pool plus a raw NIXL agent with one 1 GiB buffer."""
    import numpy as np

    from kvpush.connector.agent import AgentConfig, NixlAgent
    from kvpush.connector.layout import pool_layout
    from kvpush.connector.peering import CompatInfo
    from kvpush.connector.transport import KvTransport, TransportConfig

    dev = Dev(setup["cpu"], setup["gpu_p"] if name.endswith("-p") else setup["gpu_d"])
    t = dev.torch
    gen = dev.generator(seed)
    shape = (2, setup["num_blocks"], BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    layers = [
        t.randn(shape, dtype=t.bfloat16, device=dev.device, generator=gen) for _ in range(LAYERS)
    ]
    regions = [[kv[0], kv[1]] for kv in layers]
    layout = pool_layout(regions)
    compat = CompatInfo(
        model="kvpush-bench", dtype="bfloat16", block_size=BLOCK_SIZE, layout="gpu-flash-kv"
    )
    transport = KvTransport(
        TransportConfig(worker_id=name, compat=compat, backend_params=setup["backend_params"]),
        layout,
    )
    raw = NixlAgent(AgentConfig(name=f"{name}-raw", backend_params=setup["backend_params"]))
    buf = dev.random_bytes(setup["raw_bytes"], seed + 100)
    raw.register_rows(
        np.array([[buf.data_ptr(), buf.numel(), dev.device.index or 0]], np.uint64),
        layout.mem_type,
    )
    dev.sync()
    return {
        "dev": dev,
        "transport": transport,
        "regions": regions,
        "raw": raw,
        "buf": buf,
        "layout": layout,
    }


def digest_blocks(regions: list[list[Any]], runs: list[list[int]]) -> str:
    import torch

    ids = torch.cat([torch.arange(f, f + c) for f, c in runs]).to(regions[0][0].device)
    h = hashlib.sha256()
    for layer in regions:
        for region in layer:
            h.update(region.index_select(0, ids).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def digest_bytes(buf: Any, offset: int, nbytes: int) -> str:
    return hashlib.sha256(buf[offset : offset + nbytes].cpu().numpy()).hexdigest()


def decode_side(conn: Any, setup: dict[str, Any]) -> None:
    """The child: serves its pool and raw buffer, expects transfers, reports when each ended.
    It polls NIXL (transport + raw agent) every ``d_poll_s`` (0: busy)."""
    import msgspec

    side = make_side(setup, "gpubench-d", seed=2)
    transport, raw, buf = side["transport"], side["raw"], side["buf"]
    ended: dict[str, tuple[str, float]] = {}
    conn.send_bytes(
        msgspec.msgpack.encode([transport.address, transport.epoch, raw.metadata(), buf.data_ptr()])
    )
    interval = setup["d_poll_s"]
    while True:
        for event in transport.poll():
            ended[event.transfer_id] = (event.state.value, time.monotonic())
        raw.notifications()  # the raw agent's progress
        if not conn.poll(interval):
            continue
        cmd, *rest = msgspec.msgpack.decode(conn.recv_bytes())
        if cmd == "stop":
            break
        reply: Any
        if cmd == "expect":
            transport.expect(rest[0], 60.0)
            reply = "ok"
        elif cmd == "wait":
            limit = time.monotonic() + 60.0
            while rest[0] not in ended and time.monotonic() < limit:
                for event in transport.poll():
                    ended[event.transfer_id] = (event.state.value, time.monotonic())
            reply = ended.pop(rest[0], ("timeout", 0.0))
        elif cmd == "digest":
            reply = digest_blocks(side["regions"], rest[0])
        elif cmd == "raw_digest":
            reply = digest_bytes(buf, rest[0], rest[1])
        else:
            reply = f"unknown command {cmd}"
        conn.send_bytes(msgspec.msgpack.encode(reply))
    transport.close()
    raw.close()


# ---- the prefill side (worker) --------------------------------------------------------------


class Bench:
    def __init__(self, setup: dict[str, Any], conn: Any) -> None:
        import msgspec
        import numpy as np

        self.np, self.msgpack, self.conn = np, msgspec.msgpack, conn
        self.setup = setup
        side = make_side(setup, "gpubench-p", seed=1)
        self.dev, self.transport, self.regions = side["dev"], side["transport"], side["regions"]
        self.raw, self.src = side["raw"], side["buf"]
        self.mem = side["layout"].mem_type
        t = self.dev.torch
        self.dst = t.empty_like(self.src)  # d2d target
        self.dst.fill_(1)
        self.copy_regions = [[r.clone() for r in layer] for layer in self.regions]  # d2d_regions
        self.scratch = t.zeros(SCRATCH_BYTES, dtype=t.uint8, device=self.dev.device)
        self.dev.sync()
        address, epoch, raw_md, self.raw_dst = self.msgpack.decode(conn.recv_bytes())
        self.address, self.epoch = address, epoch
        self.raw_peer = self.raw.add_peer(raw_md)
        self.transport.connect(address, epoch)
        self.seq = 0
        self.flushes = 0

    def ctl(self, *msg: Any) -> Any:
        self.conn.send_bytes(self.msgpack.encode(list(msg)))
        if not self.conn.poll(120.0):
            raise TimeoutError(f"decode side did not answer {msg[0]}")
        return self.msgpack.decode(self.conn.recv_bytes())

    def cold(self) -> None:
        """Write a buffer > 4x L2 so every timed op starts with L2 holding none of its bytes."""
        self.flushes += 1
        self.scratch.fill_(self.flushes & 0xFF)
        self.dev.sync()

    # -- kvpush ops
    def _wait(self, tid: str) -> Any:
        limit = time.monotonic() + 60.0
        while time.monotonic() < limit:
            for event in self.transport.poll():
                if event.transfer_id == tid:
                    return event
        raise TimeoutError(f"{tid} did not end")

    def kv(
        self,
        op: str,
        local: list[list[int]],
        remote: list[list[int]],
        groups: list[list[int]],
        from_start: bool = True,
    ) -> dict[str, float]:
        """One transfer; seconds (from start_* or, ``from_start=False``, from the first post),
        start_s (start_push alone), tail_s (last post -> DONE), descriptors."""
        self.seq += 1
        tid = f"gpubench-{self.seq:08d}"
        self.ctl("expect", tid)
        posting = 0.0
        t0 = time.perf_counter()
        if op == "pull":
            self.transport.start_pull(
                tid, self.address, remote, local, 60.0, self.epoch, layer_groups=groups
            )
            t1 = last = t0
        else:
            self.transport.start_push(tid, self.address, remote, local, 60.0, self.epoch)
            t1 = last = time.perf_counter()
            for group in groups:
                last = time.perf_counter()
                self.transport.push_layers(tid, group)
                posting += time.perf_counter() - last
            self.transport.finish(tid)
        event = self._wait(tid)
        done = time.perf_counter()
        state, _ = self.ctl("wait", tid)
        if event.state.value != "done" or state != "done":
            raise RuntimeError(f"{op} {tid} ended {event.state.value}/{state}: {event.detail}")
        return {
            "s": done - (t0 if from_start else t1),
            "start_s": t1 - t0,
            "tail_s": done - last,
            "post_s": posting,
            "descriptors": event.descriptors,
        }

    # -- raw NIXL ops
    def raw_handles(self, op: str, nbytes: int, chunks: int = 1) -> list[Any]:
        nixl, np, dev = self.raw._nixl, self.np, self.dev.device.index or 0
        peer_dev = self.setup["gpu_d"] if self.dev.cuda else 0
        chunk = nbytes // chunks
        handles = []
        for i in range(chunks):
            local = np.array([[self.src.data_ptr() + i * chunk, chunk, dev]], np.uint64)
            far = np.array([[self.raw_dst + i * chunk, chunk, peer_dev]], np.uint64)
            handles.append(
                nixl.initialize_xfer(
                    op,
                    nixl.get_xfer_descs(local, self.mem.value),
                    nixl.get_xfer_descs(far, self.mem.value),
                    self.raw_peer,
                )
            )
        return handles

    def raw_op(self, op: str, nbytes: int, chunks: int = 1) -> float:
        """Requests made before the clock; timed: post all, then until every one is DONE."""
        nixl = self.raw._nixl
        handles = self.raw_handles(op, nbytes, chunks)
        try:
            t0 = time.perf_counter()
            states = [nixl.transfer(h) for h in handles]
            limit = t0 + 60.0
            while True:
                states = [
                    s if s == "DONE" else nixl.check_xfer_state(h)
                    for s, h in zip(states, handles, strict=True)
                ]
                if all(s == "DONE" for s in states):
                    break
                if any(s == "ERR" for s in states) or time.perf_counter() > limit:
                    raise RuntimeError(f"raw {op} of {nbytes} bytes: {states}")
            return time.perf_counter() - t0
        finally:
            for h in handles:
                with contextlib.suppress(Exception):
                    nixl.release_xfer_handle(h)

    # -- copies
    def d2d(self, nbytes: int) -> float:
        self.dev.sync()
        t0 = time.perf_counter()
        self.dst[:nbytes].copy_(self.src[:nbytes])
        self.dev.sync()
        return time.perf_counter() - t0

    def d2d_event(self, nbytes: int) -> float:
        if not self.dev.cuda:
            return self.d2d(nbytes)
        t = self.dev.torch
        start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        start.record()
        self.dst[:nbytes].copy_(self.src[:nbytes])
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def d2d_regions(self, blocks: int) -> float:
        self.dev.sync()
        t0 = time.perf_counter()
        for dst_layer, src_layer in zip(self.copy_regions, self.regions, strict=True):
            for dst, src in zip(dst_layer, src_layer, strict=True):
                dst[FIRST_REMOTE : FIRST_REMOTE + blocks].copy_(src[:blocks])
        self.dev.sync()
        return time.perf_counter() - t0

    # -- verification
    def verify(self, blocks: int, most: int, frag: list[list[int]]) -> list[str]:
        per_layer = [[i] for i in range(LAYERS)]
        every = [list(range(LAYERS))]
        nbytes = blocks * (1 << 20)
        checked = []
        mine = digest_blocks(self.regions, [[0, blocks]])
        for name, remote, groups in (
            ("push", [[FIRST_REMOTE, blocks]], per_layer),
            ("push_1req", [[FIRST_REMOTE, blocks]], every),
            ("push_frag", frag, per_layer),
        ):
            self.ctl("digest", remote)  # warm the digest path
            self.kv("push", [[0, blocks]], remote, groups)
            if self.ctl("digest", remote) != mine:
                raise RuntimeError(f"{name} of {blocks} blocks is not byte-exact")
            checked.append(name)
        pull_src = [[FIRST_REMOTE + 2 * most, blocks]]
        self.kv("pull", [[most, blocks]], pull_src, every)
        if digest_blocks(self.regions, [[most, blocks]]) != self.ctl("digest", pull_src):
            raise RuntimeError(f"pull of {blocks} blocks is not byte-exact")
        checked.append("pull")
        self.raw_op("READ", nbytes)
        if digest_bytes(self.src, 0, nbytes) != self.ctl("raw_digest", 0, nbytes):
            raise RuntimeError("raw READ is not byte-exact")
        checked.append("raw_read")
        self.src[:nbytes].bitwise_not_()  # fresh bytes for the WRITE check
        self.dev.sync()
        for name, chunks in (("raw", 1), ("raw_layered", LAYERS)):
            self.raw_op("WRITE", nbytes, chunks)
            if digest_bytes(self.src, 0, nbytes) != self.ctl("raw_digest", 0, nbytes):
                raise RuntimeError(f"{name} WRITE is not byte-exact")
            checked.append(name)
            self.src[:nbytes].bitwise_not_()
            self.dev.sync()
        self.d2d(nbytes)
        self.d2d_regions(blocks)
        self.dev.sync()
        if not bool((self.dst[:nbytes] == self.src[:nbytes]).all()):
            raise RuntimeError("d2d copy mismatch")
        for dst_layer, src_layer in zip(self.copy_regions, self.regions, strict=True):
            for dst, src in zip(dst_layer, src_layer, strict=True):
                if not self.dev.torch.equal(
                    dst[FIRST_REMOTE : FIRST_REMOTE + blocks], src[:blocks]
                ):
                    raise RuntimeError("d2d_regions copy mismatch")
        checked += ["d2d", "d2d_regions"]
        return checked

    def case(self, tokens: int, most: int, repeats: int, read_repeats: int) -> dict[str, Any]:
        blocks = tokens // BLOCK_SIZE
        nbytes = blocks * self.transport.layout.bytes_per_block
        straight = [[FIRST_REMOTE, blocks]]
        frag = [[FIRST_REMOTE + 4 * i, 2] for i in range(blocks // 2)]
        pull_src = [[FIRST_REMOTE + 2 * most, blocks]]
        per_layer = [[i] for i in range(LAYERS)]
        every = [list(range(LAYERS))]
        verified = self.verify(blocks, most, frag)
        runs: dict[str, list[float]] = {}
        descs: dict[str, int] = {}

        def add(key: str, seconds: float) -> None:
            runs.setdefault(key, []).append(seconds)

        for i in range(repeats):
            self.cold()
            r = self.kv("push", [[0, blocks]], straight, per_layer, from_start=False)
            add("push", r["s"])
            add("push_start", r["start_s"])
            add("push_tail", r["tail_s"])
            add("push_posts", r["post_s"])
            descs["push"] = r["descriptors"]
            self.cold()
            r = self.kv("push", [[0, blocks]], straight, every)
            add("push_1req", r["s"])
            self.cold()
            r = self.kv("push", [[0, blocks]], frag, per_layer, from_start=False)
            add("push_frag", r["s"])
            descs["push_frag"] = r["descriptors"]
            for key, op in (
                ("raw", lambda: self.raw_op("WRITE", nbytes)),
                ("raw_layered", lambda: self.raw_op("WRITE", nbytes, LAYERS)),
                ("d2d", lambda: self.d2d(nbytes)),
                ("d2d_event", lambda: self.d2d_event(nbytes)),
                ("d2d_regions", lambda: self.d2d_regions(blocks)),
            ):
                self.cold()
                add(key, op())
            if i < read_repeats:
                self.cold()
                add("pull", self.kv("pull", [[most, blocks]], pull_src, every)["s"])
                self.cold()
                add("raw_read", self.raw_op("READ", nbytes))
        med = {k: statistics.median(v) for k, v in runs.items()}
        out: dict[str, Any] = {
            "tokens": tokens,
            "kv_bytes": nbytes,
            "verified": verified,
            "repeats": {k: len(v) for k, v in runs.items()},
        }
        for key, seconds in med.items():
            if key not in ("push_start", "push_tail", "push_posts"):
                out[f"{key}_GBps"] = round(nbytes / seconds / 1e9, 3)
            out[f"{key}_ms"] = round(seconds * 1e3, 4)
            out[f"{key}_min_ms"] = round(min(runs[key]) * 1e3, 4)
        out["push_descriptors"] = descs["push"]
        out["frag_descriptors"] = descs["push_frag"]
        for num, den in (
            ("push", "raw"),
            ("push_1req", "raw"),
            ("push", "raw_layered"),
            ("push", "d2d"),
            ("raw", "d2d"),
            ("push", "d2d_regions"),
            ("pull", "raw_read"),
        ):
            out[f"{num}_vs_{den}"] = round(med[den] / med[num], 4)
        return out

    def sweep(self, sizes_mib: list[int], repeats: int, read_ok: bool) -> list[dict[str, Any]]:
        rows = []
        for mib in sizes_mib:
            nbytes = mib << 20
            if nbytes > self.src.numel():
                continue
            row: dict[str, Any] = {"mib": mib}
            for key, op, reps in (
                ("raw", lambda n=nbytes: self.raw_op("WRITE", n), repeats),
                ("d2d", lambda n=nbytes: self.d2d(n), repeats),
                ("d2d_event", lambda n=nbytes: self.d2d_event(n), repeats),
                (
                    "raw_read",
                    lambda n=nbytes: self.raw_op("READ", n),
                    repeats if read_ok else (2 if mib <= 64 else 0),
                ),
            ):
                times = []
                for _ in range(reps):
                    self.cold()
                    times.append(op())
                if times:
                    med = statistics.median(times)
                    row[f"{key}_ms"] = round(med * 1e3, 4)
                    row[f"{key}_GBps"] = round(nbytes / med / 1e9, 3)
            rows.append(row)
        return rows

    def costs(self, blocks: int, n: int = 200) -> dict[str, float]:
        """Where push's fixed time goes, per layer request (2 descriptors, ``blocks`` blocks):
        NIXL make_prepped_xfer, transfer() (the post), post -> DONE, release; plus one idle
        ``transport.poll()``. Medians in microseconds."""
        from kvpush.connector.layout import layer_index_tables

        engine = self.transport._engine
        link = engine.peers[self.address]
        nixl = self.transport._agent._nixl
        np = self.np
        local = layer_index_tables(self.transport.layout, np.arange(blocks))
        remote = layer_index_tables(link.info.pool, np.arange(blocks) + FIRST_REMOTE)
        keys = ("make_us", "post_us", "done_us", "release_us", "request_us")
        parts: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(n):
            layer = i % LAYERS
            t0 = time.perf_counter()
            h = nixl.make_prepped_xfer(
                "WRITE", engine.local_prep, local[layer], link.prep, remote[layer]
            )
            t1 = time.perf_counter()
            state = nixl.transfer(h)
            t2 = time.perf_counter()
            while state == "PROC":
                state = nixl.check_xfer_state(h)
            t3 = time.perf_counter()
            nixl.release_xfer_handle(h)
            t4 = time.perf_counter()
            if state != "DONE":
                raise RuntimeError(f"cost probe WRITE ended {state}")
            for key, sec in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                parts[key].append(sec * 1e6)
        polls = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.transport.poll()
            polls.append((time.perf_counter() - t0) * 1e6)
        out: dict[str, float] = {k: round(statistics.median(v), 2) for k, v in parts.items()}
        out["idle_poll_us"] = round(statistics.median(polls), 2)
        out["blocks"] = blocks
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send_bytes(self.msgpack.encode(["stop"]))
        self.transport.close()
        self.raw.close()


def fit(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Least squares ms = fixed + bytes / bandwidth over the sweep."""
    pts = [(r["mib"] * (1 << 20), r[f"{key}_ms"] / 1e3) for r in rows if f"{key}_ms" in r]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return {
        "fixed_ms": round((my - slope * mx) * 1e3, 4),
        "GBps": round(1 / slope / 1e9, 1) if slope > 0 else float("inf"),
    }


def worker(args: argparse.Namespace) -> int:
    """The prefill side of one variant: spawns the decode side, measures, writes JSON."""
    import multiprocessing as mp

    env, d_poll_s, about = VARIANTS[args.worker]
    most = max(args.tokens) // BLOCK_SIZE
    setup = {
        "cpu": args.cpu,
        "gpu_p": args.gpu_p,
        "gpu_d": args.gpu_d,
        "num_blocks": FIRST_REMOTE + 3 * most,
        "raw_bytes": max(max(args.sweep_mib) << 20, most << 20),  # 1 MiB per block
        "backend_params": {"ucx_error_handling_mode": "none"},
        "d_poll_s": d_poll_s,
    }
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, setup), daemon=True)
    proc.start()
    bench = None
    result: dict[str, Any] = {
        "variant": args.worker,
        "about": about,
        "ucx_env": env,
        "d_poll_s": d_poll_s,
    }
    try:
        if not parent.poll(180.0):
            raise TimeoutError("decode side did not start")
        started = time.monotonic()
        bench = Bench(setup, parent)
        result["setup_s"] = round(time.monotonic() - started, 2)
        # Is READ on a fast lane? One 16 MiB READ decides how many READ repeats we can afford.
        bench.raw_op("READ", 1 << 20)
        probe = bench.raw_op("READ", 16 << 20)
        read_ok = probe < 0.005
        result["read_probe_ms"] = round(probe * 1e3, 3)
        read_repeats = args.repeats if read_ok else 3
        result["cases"] = [
            bench.case(tokens, most, args.repeats, read_repeats) for tokens in args.tokens
        ]
        result["costs"] = bench.costs(min(args.tokens) // BLOCK_SIZE)
        if args.worker in args.sweep_variants:
            result["sweep"] = bench.sweep(args.sweep_mib, args.sweep_repeats, read_ok)
            result["fit"] = {k: fit(result["sweep"], k) for k in ("raw", "d2d", "raw_read")}
        result["seconds"] = round(time.monotonic() - started, 1)
        result["ok"] = True
    except Exception as exc:  # reported, so the other variants still run
        import traceback

        traceback.print_exc()
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        if bench is not None:
            bench.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


# ---- orchestrator ---------------------------------------------------------------------------

_PREFIX = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s*")
_LANES = re.compile(r"UCX\s+INFO\s+(\S+) (intra-node cfg#\d+ .*)$")
_TABLE_AGENT = re.compile(r"^\| (\S+) intra-node (cfg#\d+)")
_TABLE_OP = re.compile(r"^\| (remote memory .*?)\s*\|$")


def _agent_label(name: str) -> str:
    side = "P" if name.startswith("gpubench-p") else "D"
    return f"{side} {'raw' if name.endswith('-raw') else 'kvpush'}"


def ucx_choices(log: str) -> dict[str, list[str]]:
    """Lane configs (UCX_LOG_LEVEL=info) and protocol tables (UCX_PROTO_INFO=y) from a log."""
    clean = [_PREFIX.sub("", line).strip() for line in log.splitlines()]
    lanes: list[str] = []
    protos: list[str] = []
    for i, line in enumerate(clean):
        lane = _LANES.search(line)
        if lane:
            entry = f"{_agent_label(lane.group(1))}: {lane.group(2)}"
            if entry not in lanes:
                lanes.append(entry)
            continue
        op = _TABLE_OP.match(line)
        if not op:
            continue
        agent = _TABLE_AGENT.match(clean[i - 1]) if i else None
        if agent is None:  # loopback (self) tables
            continue
        rows, seps = [], 0
        for nxt in clean[i + 1 : i + 24]:
            if nxt.startswith("+"):
                seps += 1
                if seps == 3:
                    break
            elif nxt.startswith("|") and "Range" not in nxt:
                rows.append(" ".join(nxt.strip("| ").split()))
        who = f"{_agent_label(agent.group(1))} {agent.group(2)}"
        entry = f"{who}: {op.group(1)}: " + " ; ".join(rows)
        if entry not in protos:
            protos.append(entry)
    return {"lanes": lanes, "protocols": protos}


def run_variant(name: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    env_extra, _, about = VARIANTS[name]
    timeout = args.variant_timeout_s
    env = dict(os.environ)
    env.update(env_extra)
    env.setdefault("UCX_PROTO_INFO", "y")
    env.setdefault("UCX_LOG_LEVEL", "info")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "result.json"
        out_log = Path(tmp) / "worker.log"
        cmd = [
            sys.executable,
            "-m",
            "tests.gpu.gpu_transport",
            "--worker",
            name,
            "--json",
            str(out_json),
            "--repeats",
            str(args.repeats),
            "--sweep-repeats",
            str(args.sweep_repeats),
            "--gpu-p",
            str(args.gpu_p),
            "--gpu-d",
            str(args.gpu_d),
            "--tokens",
            *map(str, args.tokens),
            "--sweep-mib",
            *map(str, args.sweep_mib),
            "--sweep-variants",
            *args.sweep_variants,
        ]
        if args.cpu:
            cmd.append("--cpu")
        started = time.monotonic()
        print(f"== variant {name}: {about}", flush=True)
        with open(out_log, "w") as f:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
                rc = -9
        text = out_log.read_text(errors="replace")
        log.write(f"\n===== variant {name} ({about}); env {env_extra}; rc {rc} =====\n{text}")
        log.flush()
        result = (
            json.loads(out_json.read_text())
            if out_json.exists()
            else {
                "variant": name,
                "about": about,
                "ok": False,
                "error": f"worker exited {rc} without a result (timeout {timeout}s?)",
            }
        )
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["ucx"] = ucx_choices(text)
    if not result.get("ok"):
        print(f"   FAILED: {result.get('error')}\n   log tail:\n" + text[-2000:], flush=True)
    return result


_COLUMNS = (
    ("variant", "{variant}"),
    ("tokens", "{tokens}"),
    ("KV MiB", "{mib:.0f}"),
    ("push GB/s (ms)", "{push_GBps:.1f} ({push_ms:.3f})"),
    ("8 posts / tail ms", "{push_posts_ms:.3f} / {push_tail_ms:.3f}"),
    ("start_push ms", "{push_start_ms:.3f}"),
    ("push 1-req GB/s (ms)", "{push_1req_GBps:.1f} ({push_1req_ms:.3f})"),
    ("push frag GB/s (descs)", "{push_frag_GBps:.1f} ({frag_descriptors})"),
    ("raw WRITE GB/s (ms)", "{raw_GBps:.1f} ({raw_ms:.3f})"),
    ("raw WRITE/layer GB/s", "{raw_layered_GBps:.1f}"),
    ("d2d copy GB/s (ms)", "{d2d_GBps:.1f} ({d2d_ms:.3f})"),
    ("d2d 16 regions GB/s", "{d2d_regions_GBps:.1f}"),
    ("push/raw", "{push_vs_raw:.3f}"),
    ("push/d2d", "{push_vs_d2d:.4f}"),
    ("raw/d2d", "{raw_vs_d2d:.4f}"),
    ("pull GB/s (ms)", "{pull_GBps:.2f} ({pull_ms:.2f})"),
    ("raw READ GB/s", "{raw_read_GBps:.2f}"),
)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for res in results:
        for case in res.get("cases", []):
            label = f"{res['variant']}#{res.get('round', 1)}"
            values = {**case, "variant": label, "mib": case["kv_bytes"] / 2**20}
            lines.append("| " + " | ".join(f.format(**values) for _, f in _COLUMNS) + " |")
    return "\n".join(lines)


def sweep_table(res: dict[str, Any]) -> str:
    head = "| size MiB | raw WRITE ms (GB/s) | d2d ms (GB/s) | d2d event ms | raw READ ms (GB/s) |"
    lines = [head, "|---|---|---|---|---|"]
    for r in res.get("sweep", []):

        def cell(key: str, r: dict[str, Any] = r) -> str:
            ms = r.get(f"{key}_ms")
            return "-" if ms is None else f"{ms:.3f} ({r[f'{key}_GBps']:.1f})"

        lines.append(
            f"| {r['mib']} | {cell('raw')} | {cell('d2d')} | "
            f"{r.get('d2d_event_ms', '-')} | {cell('raw_read')} |"
        )
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> int:
    results = []
    env = environment(args.cpu)
    print("environment:", json.dumps(env), flush=True)
    started = time.monotonic()
    log_path = Path(args.log) if args.log else Path(tempfile.mkdtemp()) / "gpu_transport.log"
    with open(log_path, "w") as log:
        for round_ in range(1, args.rounds + 1):
            for name in args.variants:
                res = run_variant(name, args, log)
                res["round"] = round_
                results.append(res)
    summary = {
        "command": " ".join(sys.argv),
        "environment": env,
        "variants": results,
        "total_s": round(time.monotonic() - started, 1),
        "cpu_dry_run": args.cpu,
    }
    for res in results:
        print(
            f"\n== {res['variant']}#{res.get('round')} ({res.get('about')}): ok={res.get('ok')} "
            f"wall {res.get('wall_s')}s read_probe_ms={res.get('read_probe_ms')} "
            f"{res.get('error', '')}"
        )
        for lane in res["ucx"]["lanes"]:
            print("   lanes:", lane)
        for proto in res["ucx"]["protocols"]:
            print("   proto:", proto)
        print("   costs:", res.get("costs"))
        if res.get("sweep"):
            print(sweep_table(res))
            print("   fit (ms = fixed + bytes/bw):", res.get("fit"))
    print("\n" + table(results))
    print(f"\nlog: {log_path}; total {summary['total_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if all(r.get("ok") for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--log", metavar="OUT", help="every worker's output (UCX's choices)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2, help="run the variant list N times")
    parser.add_argument("--sweep-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--sweep-repeats", type=int, default=10)
    parser.add_argument("--sweep-variants", nargs="*", default=["default", "get_zcopy"])
    parser.add_argument("--variant-timeout-s", type=float, default=100.0)
    parser.add_argument("--gpu-p", type=int, default=0, help="prefill side's CUDA device")
    parser.add_argument("--gpu-d", type=int, default=0, help="decode side's CUDA device")
    parser.add_argument("--cpu", action="store_true", help="dry run on host memory (not a result)")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(t % BLOCK_SIZE or t <= 0 for t in args.tokens):
        parser.error(f"--tokens must be positive multiples of {BLOCK_SIZE}")
    reason = skip_reason(args.cpu)
    if reason is not None:
        print(f"SKIP: {reason}")
        return 0
    ensure_kvpush_importable()
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
