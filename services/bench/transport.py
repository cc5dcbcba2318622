"""Transport benchmark: kvpush push/pull between two processes vs a raw NIXL WRITE and memcpy.

KV of the bench model (kvpush model bench: 8 layers, 4 KV heads, head_dim 64, fp32, block size
128, vLLM CPU layout: one [blocks, kv_heads, 128, 2*head_dim] tensor per layer, 256 KiB per
layer per block) at 512, 2048 and 8192 tokens. This process is the prefill side; a spawned child
is the decode side. For every case, after one verified warm-up (byte-exact digests), the median
over --repeats of (each op starts with caches swept cold):

  push       one WRITE per layer (push_layers after each layer) + finish: P blocks [0, n) into D
             blocks [8, 8+n), one descriptor per layer; timed from the first post until poll()
             reports DONE (every WRITE done, completion notice sent). start_push (announcement
             arrived, prefill still computing: off the critical path) is timed on its own, and
             so is the tail: last post -> DONE, what a streamed push adds after the last layer
  push-1req  the same bytes in one request, timed from start_push (announcement arrived after
             prefill ended: everything is on the critical path)
  push-frag  one request per layer into D blocks in 2-block runs (n/2 descriptors per layer)
  pull       one READ of all layers + the notice to the block owner (the KvReady flow)
  raw        one single-descriptor NIXL WRITE of the same bytes between two plain buffers;
             also as one such WRITE per layer-sized chunk (push's request structure), and one
             single-descriptor READ (pull's comparison)
  memcpy     numpy copy of the same bytes inside one process

GB/s are 1e9 bytes per second. --json OUT writes {"cases": [{"tokens", "push_GBps",
"pull_GBps", "raw_GBps", "memcpy_GBps", ...}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 128
FIRST_REMOTE = 8  # D's blocks start here: an offset, as after other requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="run nothing: print the summary of DIR/run-*.json (earlier --json outputs): "
        "medians over the runs, ratio spreads, one line per run",
    )
    parser.add_argument(
        "--doc",
        metavar="FILE",
        help="with --report: write the summary into FILE's generated section",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --report --doc: change nothing, exit 1 if FILE is not what DIR generates",
    )
    parser.add_argument("--repeats", type=int, default=25, help="timed repeats per case")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[512, 2048, 8192],
        help="prompt lengths (multiples of 128)",
    )
    parser.add_argument(
        "--error-mode",
        choices=["none", "peer"],
        default="none",
        help="UCX ucx_error_handling_mode (default none: CMA + shared memory)",
    )
    parser.add_argument(
        "--descriptors",
        choices=["prepped", "rows"],
        default="prepped",
        help="prepped per-block lists (default) or coalesced rows per request",
    )


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from kvpush.services.models import BENCH

    most = max(args.tokens) // BLOCK_SIZE
    return {
        "layers": BENCH.layers,
        "kv_heads": BENCH.kv_heads,
        "head_dim": BENCH.head_dim,
        "num_blocks": FIRST_REMOTE + 3 * most,  # push/frag span [8, 8+2n); pull reads after
        "raw_bytes": most * BENCH.layers * BENCH.kv_heads * BLOCK_SIZE * 2 * BENCH.head_dim * 4,
        "backend_params": {"ucx_error_handling_mode": args.error_mode},
        "prep_limit": 0 if args.descriptors == "rows" else 1 << 18,
    }


def _side(setup: dict[str, Any], name: str, seed: int) -> tuple[Any, list[Any], Any, Any]:
    """A transport over random pools plus a raw NIXL agent with one registered buffer."""
    import numpy as np

    from kvpush.connector import (
        AgentConfig,
        CompatInfo,
        KvTransport,
        MemType,
        NixlAgent,
        TransportConfig,
        pool_layout,
    )

    rng = np.random.default_rng(seed)
    shape = (setup["num_blocks"], setup["kv_heads"], BLOCK_SIZE, 2 * setup["head_dim"])
    pools = [rng.standard_normal(shape, dtype=np.float32) for _ in range(setup["layers"])]
    compat = CompatInfo(
        model="kvpush-bench", dtype="float32", block_size=BLOCK_SIZE, layout="cpu-kv-concat"
    )
    transport = KvTransport(
        TransportConfig(
            worker_id=name,
            compat=compat,
            backend_params=setup["backend_params"],
            prep_limit=setup["prep_limit"],
        ),
        pool_layout([[p] for p in pools]),
    )
    raw = NixlAgent(AgentConfig(name=f"{name}-raw", backend_params=setup["backend_params"]))
    buf = np.frombuffer(rng.bytes(setup["raw_bytes"]), dtype=np.uint8).copy()
    raw.register_rows(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), MemType.DRAM)
    return transport, pools, raw, buf


def _digest(pools: list[Any], runs: list[list[int]]) -> str:
    import hashlib

    from kvpush.connector import runs_to_ids

    ids = runs_to_ids(runs)
    h = hashlib.sha256()
    for pool in pools:
        h.update(pool[ids].tobytes())
    return h.hexdigest()


def _decode_side(conn: Any, setup: dict[str, Any]) -> None:
    """The child: serves its pool, expects transfers, reports when each one ended."""
    import msgspec

    transport, pools, raw, buf = _side(setup, "bench-d", seed=2)
    ended: dict[str, tuple[str, float]] = {}
    conn.send_bytes(
        msgspec.msgpack.encode(
            [transport.address, transport.epoch, raw.metadata(), buf.ctypes.data]
        )
    )
    while True:
        for event in transport.poll():
            ended[event.transfer_id] = (event.state.value, time.monotonic())
        raw.notifications()  # the raw agent's progress (needed in UCX peer mode)
        if not conn.poll(0.0002):
            continue
        cmd, *rest = msgspec.msgpack.decode(conn.recv_bytes())
        if cmd == "stop":
            break
        if cmd == "expect":
            transport.expect(rest[0], 30.0)
            reply: Any = "ok"
        elif cmd == "wait":
            limit = time.monotonic() + 10.0
            while rest[0] not in ended and time.monotonic() < limit:
                for event in transport.poll():
                    ended[event.transfer_id] = (event.state.value, time.monotonic())
            reply = ended.pop(rest[0], ("timeout", 0.0))
        elif cmd == "digest":
            reply = _digest(pools, rest[0])
        else:
            reply = f"unknown command {cmd}"
        conn.send_bytes(msgspec.msgpack.encode(reply))
    transport.close()
    raw.close()


class _Bench:
    """The prefill side: the transport, the raw agent, the control pipe, the timed ops."""

    def __init__(self, setup: dict[str, Any], conn: Any) -> None:
        import msgspec
        import numpy as np

        from kvpush.connector import MemType

        self.np, self.msgpack, self.mem = np, msgspec.msgpack, MemType.DRAM
        self.conn = conn
        self.layers = setup["layers"]
        self.transport, self.pools, self.raw, self.src = _side(setup, "bench-p", seed=1)
        self.dst = np.zeros_like(self.src)  # memcpy target, faulted in below
        self.dst[:] = 1
        self.scratch = np.ones(64 << 20, dtype=np.uint8)  # 2x this box's L3
        address, epoch, raw_md, self.raw_dst = self.msgpack.decode(conn.recv_bytes())
        self.address, self.epoch = address, epoch
        self.raw_peer = self.raw.add_peer(raw_md)
        self.transport.connect(address, epoch)
        self.seq = 0

    def ctl(self, *msg: Any) -> Any:
        self.conn.send_bytes(self.msgpack.encode(list(msg)))
        if not self.conn.poll(30.0):
            raise TimeoutError(f"decode side did not answer {msg[0]}")
        return self.msgpack.decode(self.conn.recv_bytes())

    def _tid(self) -> str:
        self.seq += 1
        return f"bench-{self.seq:08d}"

    def _wait(self, tid: str) -> Any:
        limit = time.monotonic() + 30.0
        while time.monotonic() < limit:
            for event in self.transport.poll():
                if event.transfer_id == tid:
                    return event
        raise TimeoutError(f"{tid} did not end")

    def kv(
        self,
        op: str,
        blocks: int,
        remote: list[list[int]],
        groups: list[list[int]],
        from_start: bool = True,
    ) -> tuple[float, float, int, float, float]:
        """(seconds to DONE, seconds in start_*, descriptors, ms until D saw the notice, seconds
        from the last post to DONE: the part of a streamed push left after the last layer).

        ``from_start=False`` starts the clock at the first post: in the streaming flow the
        announcement (start_push) arrives while the prefill still computes, off the critical
        path; its own cost is the second number.
        """
        tid = self._tid()
        self.ctl("expect", tid)
        local = [[0, blocks]]
        t0 = time.perf_counter()
        if op == "pull":
            self.transport.start_pull(
                tid, self.address, remote, local, 30.0, self.epoch, layer_groups=groups
            )
            t1 = last = t0
        else:
            self.transport.start_push(tid, self.address, remote, local, 30.0, self.epoch)
            t1 = time.perf_counter()
            for group in groups:
                last = time.perf_counter()
                self.transport.push_layers(tid, group)
            self.transport.finish(tid)
        event = self._wait(tid)
        done, ended = time.perf_counter(), time.monotonic()
        state, seen = self.ctl("wait", tid)
        if event.state.value != "done" or state != "done":
            raise RuntimeError(f"{op} {tid} ended {event.state.value}/{state}: {event.detail}")
        elapsed = done - (t0 if from_start else t1)
        return elapsed, t1 - t0, event.descriptors, max(0.0, (seen - ended) * 1e3), done - last

    def raw_op(self, nbytes: int, op: str = "WRITE", requests: int = 1) -> float:
        """``requests`` single-descriptor requests back to back over ``nbytes`` (plain buffers)."""
        from kvpush.connector import XferStatus

        chunk = nbytes // requests
        t0 = time.perf_counter()
        for i in range(requests):
            row = self.np.array([[self.src.ctypes.data + i * chunk, chunk, 0]], self.np.uint64)
            far = self.np.array([[self.raw_dst + i * chunk, chunk, 0]], self.np.uint64)
            handle, status = self.raw.post_rows(op, row, far, self.raw_peer, self.mem, chunk)
            while status is XferStatus.PROC:
                status, _ = self.raw.status(handle)
            self.raw.release(handle)
            if status is not XferStatus.DONE:
                raise RuntimeError(f"raw {op} failed")
        return time.perf_counter() - t0

    def cold(self) -> None:
        """Sweep a buffer twice the L3 so every timed op starts with cold caches (otherwise an
        op that follows one reading the same blocks runs faster: order, not transport)."""
        self.scratch += 1

    def memcpy(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.np.copyto(self.dst[:nbytes], self.src[:nbytes])
        return time.perf_counter() - t0

    def verify(self, blocks: int, frag: list[list[int]], tail: list[list[int]]) -> None:
        per_layer = [[i] for i in range(self.layers)]
        checks = (("push", [[FIRST_REMOTE, blocks]]), ("push", frag), ("pull", tail))
        for op, remote in checks:
            self.kv(op, blocks, remote, per_layer if op == "push" else [list(range(self.layers))])
            if self.ctl("digest", remote) != _digest(self.pools, [[0, blocks]]):
                raise RuntimeError(f"{op} into {remote[:2]}... is not byte-exact")

    def case(self, tokens: int, repeats: int) -> dict[str, Any]:
        import statistics

        blocks = tokens // BLOCK_SIZE
        nbytes = blocks * self.transport.layout.bytes_per_block
        straight = [[FIRST_REMOTE, blocks]]
        frag = [[FIRST_REMOTE + 4 * i, 2] for i in range(blocks // 2)]
        pull_src = [[FIRST_REMOTE + 2 * blocks, blocks]]
        per_layer = [[i] for i in range(self.layers)]
        every = [list(range(self.layers))]
        self.verify(blocks, frag, pull_src)
        keys = (
            "push",
            "push_1req",
            "push_frag",
            "pull",
            "raw",
            "raw_layered",
            "raw_read",
            "memcpy",
            "push_start",
            "push_tail",
        )
        runs: dict[str, list[float]] = {k: [] for k in keys}
        notify, descs = [], {}
        for _ in range(repeats):
            self.cold()
            seconds, start, descs["push"], ms, last = self.kv(
                "push", blocks, straight, per_layer, from_start=False
            )
            runs["push"].append(seconds)
            runs["push_start"].append(start)
            runs["push_tail"].append(last)
            notify.append(ms)
            self.cold()
            runs["push_1req"].append(self.kv("push", blocks, straight, every)[0])
            self.cold()
            seconds, _, descs["frag"], _, _ = self.kv(
                "push", blocks, frag, per_layer, from_start=False
            )
            runs["push_frag"].append(seconds)
            self.cold()
            runs["pull"].append(self.kv("pull", blocks, pull_src, every)[0])
            for key, op in (
                ("raw", lambda: self.raw_op(nbytes)),
                ("raw_layered", lambda: self.raw_op(nbytes, requests=self.layers)),
                ("raw_read", lambda: self.raw_op(nbytes, "READ")),
                ("memcpy", lambda: self.memcpy(nbytes)),
            ):
                self.cold()
                runs[key].append(op())
        med = {k: statistics.median(v) for k, v in runs.items()}
        out: dict[str, Any] = {"tokens": tokens, "kv_bytes": nbytes}
        for key, seconds in med.items():
            if key not in ("push_start", "push_tail"):
                out[f"{key}_GBps"] = round(nbytes / seconds / 1e9, 3)
            out[f"{key}_ms"] = round(seconds * 1e3, 3)
        out.update(
            push_descriptors=descs["push"],
            frag_descriptors=descs["frag"],
            notify_ms=round(statistics.median(notify), 3),
            push_vs_raw=round(med["raw"] / med["push"], 3),
            push_vs_raw_layered=round(med["raw_layered"] / med["push"], 3),
            pull_vs_raw_read=round(med["raw_read"] / med["pull"], 3),
        )
        return out

    def close(self) -> None:
        self.conn.send_bytes(self.msgpack.encode(["stop"]))
        self.transport.close()
        self.raw.close()


def main(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    from kvpush.services.bench import docgen, transport_report

    if args.report:
        return transport_report.report(Path(args.report), args.doc, args.check)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if any(t % BLOCK_SIZE or t <= 0 for t in args.tokens):
        print(f"--tokens must be positive multiples of {BLOCK_SIZE}")
        return 2
    setup = _setup(args)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, setup), daemon=True)
    proc.start()
    bench = None
    try:
        if not parent.poll(120.0):
            raise TimeoutError("decode side did not start")
        bench = _Bench(setup, parent)
        started = time.monotonic()
        cases = [bench.case(tokens, args.repeats) for tokens in args.tokens]
        print(
            f"kvpush bench transport: two processes, UCX error mode {args.error_mode}, "
            f"{args.descriptors} descriptors, median of {args.repeats} "
            f"({time.monotonic() - started:.1f}s, load {os.getloadavg()[0]:.2f})"
        )
        elapsed_s, load = time.monotonic() - started, os.getloadavg()[0]
        print(transport_report.table(cases))
        if args.json:
            settings = {
                "error_mode": args.error_mode,
                "descriptors": args.descriptors,
                "repeats": args.repeats,
            }
            meta = {
                "date": docgen.stamp(),
                "kvpush_rev": docgen.revision(),
                "repeats": args.repeats,
                "elapsed_s": round(elapsed_s, 1),
                "load_avg": round(load, 2),
            }
            document = {"meta": meta, "cases": [{**case, **settings} for case in cases]}
            with open(args.json, "w") as f:
                json.dump(document, f, indent=1)
        return 0
    finally:
        if bench is not None:
            bench.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
