"""Transport benchmark: kvpush push/pull between two processes vs a raw NIXL WRITE and memcpy.

The KV pools (``transport_side.py``): --device cpu, the bench model's KV in vLLM's CPU layout;
--device cuda, the Llama-3-8B shape's KV (16 MiB per 128-token block) in vLLM's FlashAttention
layout on one GPU. Cases of 512, 2048 and 8192 tokens (128-token blocks). This process is the
prefill side; a spawned child is the decode side (its Poller polls as a kvpush worker's does).
For every case, after one verified warm-up (byte-exact digests), the median over --repeats of
(each op starts with caches swept cold):

  push       one WRITE per layer (push_layers after each layer) + finish: P blocks [0, n) into D
             blocks [8, 8+n); timed from the first post until poll() reports DONE (every WRITE
             done, completion notice sent). start_push (announcement arrived, prefill still
             computing: off the critical path) is timed on its own, and so is the tail: last
             post -> DONE
  push-1req  the same bytes in one request, timed from start_push (announcement arrived after
             prefill ended: everything is on the critical path)
  push-frag  one request per layer into D blocks in 2-block runs
  pull       one READ of all layers + the notice to the block owner (the KvReady flow)
  raw        one single-descriptor NIXL WRITE of the same bytes between two plain buffers;
             also as one such WRITE per layer-sized chunk (push's request structure), and one
             single-descriptor READ (pull's comparison)
  memcpy     a copy of the same bytes inside one process (numpy; cuda: device to device)
  stream     the push as the connector runs it in serving: announcement first, each layer
             pushed once computed (--layer-ms of compute per layer; on CUDA the layer gate's
             thread posts once the GPU ran the layer, as in serving), both sides driven by
             Pollers with a worker's intervals (--poll-us overrides them). Reports the
             forward thread's cost per layer and the tail from the last layer computed to P's
             DONE and to D seeing it: the push's fixed cost per transfer on the critical path

GB/s are 1e9 bytes per second. --json OUT writes {"cases": [{"tokens", "push_GBps",
"pull_GBps", "raw_GBps", "memcpy_GBps", "stream_d_tail_us", ...}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import time
from pathlib import Path
from typing import Any

from kvpush.benchmarks.transport_side import (
    BLOCK_SIZE,
    FIRST_REMOTE,
    Side,
    decode_side,
    intervals,
    make_setup,
    poll_us,
)


def _poll_us(text: str) -> tuple[float, float]:
    """``BUSY,TARGET`` in us -> (busy, target) in seconds."""
    try:
        busy, target = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want BUSY,TARGET in us, e.g. 50,200") from None
    if busy <= 0 or target <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: intervals must be positive")
    return busy / 1e6, target / 1e6


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
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the KV lives: cpu (the bench model's KV, numpy) or cuda (the Llama-3-8B "
        "shape's KV in vLLM's FlashAttention layout on --gpu, torch; READs with cuda_ipc "
        "GET zero-copy on)",
    )
    parser.add_argument("--gpu", type=int, default=0, help="cuda: the GPU of both sides")
    parser.add_argument(
        "--layer-ms",
        type=float,
        default=1.0,
        help="the streamed case: one layer's compute in ms (default 1.0; an 8B prefill of 2k "
        "tokens on an H200 is ~1.6 ms a layer)",
    )
    parser.add_argument(
        "--poll-us",
        metavar="BUSY,TARGET",
        type=_poll_us,
        default=None,
        help="the streamed case: the pollers' busy and target intervals in us (default: what "
        "a kvpush worker uses)",
    )
    parser.add_argument(
        "--stream-only",
        action="store_true",
        help="measure the streamed case alone (and one idle poll's cost): to compare settings",
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


STREAM_KEYS = ("forward_us", "post_us", "p_tail_us", "d_tail_us")


class _Bench:
    """The prefill side: the transport, the raw agent, the control pipe, the timed ops."""

    def __init__(self, setup: dict[str, Any], conn: Any) -> None:
        import msgspec

        self.msgpack = msgspec.msgpack
        self.conn, self.setup = conn, setup
        self.side = Side(setup, "bench-p", seed=1)
        self.transport, self.layers = self.side.transport, self.side.layers
        address, epoch, raw_md, self.raw_dst = self.msgpack.decode(conn.recv_bytes())
        self.address, self.epoch = address, epoch
        self.raw_peer = self.side.raw.add_peer(raw_md)
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

    def stream(self, blocks: int, remote: list[list[int]], layer_s: float) -> dict[str, float]:
        """A push as in serving: the announcement first, then layer by layer as each is
        computed (``spin``), posted the way the connector posts (on CUDA by the layer gate's
        thread once the GPU ran the layer; on CPU inline), both sides driven by Pollers with
        a worker's intervals. Returns the forward thread's cost per layer (``record`` on CUDA,
        ``push_layers`` on CPU) and the tail: last layer computed -> P's DONE / D saw it."""
        from kvpush.connector import LayerGate, Poller

        tid, last = self._tid(), self.layers - 1
        self.ctl("expect", tid)
        self.transport.start_push(tid, self.address, remote, [[0, blocks]], 30.0, self.epoch)
        ready: dict[int, float] = {}
        done: dict[str, Any] = {}

        def on_ready(layer: int) -> None:
            ready[layer] = time.monotonic()
            self.transport.push_layers(tid, [layer])
            if layer == last:
                self.transport.finish(tid)
                ready[-1] = time.monotonic()  # the last layer's WRITE posted

        box: list[Any] = []  # the poller, once built (its thread may call on_events first)

        def on_events() -> None:
            now = time.monotonic()
            while box:
                try:
                    event = box[0].events.get_nowait()
                except queue.Empty:
                    return
                done[event.transfer_id] = (event, now)

        gate = None
        try:
            box.append(
                Poller(self.transport, **self.setup["intervals"]["prefill"], on_events=on_events)
            )
            gate = LayerGate(on_ready) if self.side.cuda else None
            forward = 0.0
            for layer in range(self.layers):
                self.side.spin(layer_s)
                t0 = time.perf_counter()
                if gate is not None:
                    gate.record(layer)
                else:
                    on_ready(layer)
                forward += time.perf_counter() - t0
            if gate is not None:
                gate.drain()
            limit = time.monotonic() + 30.0
            while tid not in done and time.monotonic() < limit:
                time.sleep(0.0001)
        finally:
            if gate is not None:
                gate.close()
            if box:
                box[0].stop()
        on_events()  # an event queued before the poller was in the box (a failed start)
        if tid not in done:
            raise TimeoutError(f"streamed push {tid} did not end")
        event, p_done = done[tid]
        state, seen = self.ctl("wait", tid)
        if event.state.value != "done" or state != "done":
            raise RuntimeError(f"stream {tid} ended {event.state.value}/{state}: {event.detail}")
        return {
            "forward_us": forward / self.layers * 1e6,
            "post_us": (ready[-1] - ready[last]) * 1e6,
            "p_tail_us": (p_done - ready[last]) * 1e6,
            "d_tail_us": (seen - ready[last]) * 1e6,
        }

    def raw_op(self, nbytes: int, op: str = "WRITE", requests: int = 1) -> float:
        """``requests`` single-descriptor requests back to back over ``nbytes`` (plain buffers)."""
        from kvpush.connector import XferStatus

        raw, chunk = self.side.raw, nbytes // requests
        t0 = time.perf_counter()
        for i in range(requests):
            row = self.side.raw_row(i * chunk, chunk)
            far = self.side.raw_row(i * chunk, chunk, base=self.raw_dst)
            handle, status = raw.post_rows(op, row, far, self.raw_peer, self.side.mem, chunk)
            while status is XferStatus.PROC:
                status, _ = raw.status(handle)
            raw.release(handle)
            if status is not XferStatus.DONE:
                raise RuntimeError(f"raw {op} failed")
        return time.perf_counter() - t0

    def verify(self, blocks: int, frag: list[list[int]], tail: list[list[int]]) -> None:
        per_layer = [[i] for i in range(self.layers)]
        checks = (("push", [[FIRST_REMOTE, blocks]]), ("push", frag), ("pull", tail))
        for op, remote in checks:
            self.kv(op, blocks, remote, per_layer if op == "push" else [list(range(self.layers))])
            if self.ctl("digest", remote) != self.side.digest([[0, blocks]]):
                raise RuntimeError(f"{op} into {remote[:2]}... is not byte-exact")
        self.stream(blocks, [[FIRST_REMOTE, blocks]], 0.0)
        if self.ctl("digest", [[FIRST_REMOTE, blocks]]) != self.side.digest([[0, blocks]]):
            raise RuntimeError("the streamed push is not byte-exact")

    def case(
        self, tokens: int, repeats: int, layer_s: float, stream_only: bool = False
    ) -> dict[str, Any]:
        import statistics

        blocks = tokens // BLOCK_SIZE
        nbytes = blocks * self.transport.layout.bytes_per_block
        straight = [[FIRST_REMOTE, blocks]]
        frag = [[FIRST_REMOTE + 4 * i, 2] for i in range(blocks // 2)]
        pull_src = [[FIRST_REMOTE + 2 * blocks, blocks]]
        per_layer = [[i] for i in range(self.layers)]
        every = [list(range(self.layers))]
        self.verify(blocks, frag, pull_src)
        if stream_only:
            return self._stream_case(tokens, nbytes, repeats, layer_s)
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
            self.side.cold()
            seconds, start, descs["push"], ms, last = self.kv(
                "push", blocks, straight, per_layer, from_start=False
            )
            runs["push"].append(seconds)
            runs["push_start"].append(start)
            runs["push_tail"].append(last)
            notify.append(ms)
            self.side.cold()
            runs["push_1req"].append(self.kv("push", blocks, straight, every)[0])
            self.side.cold()
            seconds, _, descs["frag"], _, _ = self.kv(
                "push", blocks, frag, per_layer, from_start=False
            )
            runs["push_frag"].append(seconds)
            self.side.cold()
            runs["pull"].append(self.kv("pull", blocks, pull_src, every)[0])
            for key, op in (
                ("raw", lambda: self.raw_op(nbytes)),
                ("raw_layered", lambda: self.raw_op(nbytes, requests=self.layers)),
                ("raw_read", lambda: self.raw_op(nbytes, "READ")),
                ("memcpy", lambda: self.side.copy(nbytes)),
            ):
                self.side.cold()
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
        out.update(self._streamed(blocks, repeats, layer_s))
        return out

    def _streamed(self, blocks: int, repeats: int, layer_s: float) -> dict[str, float]:
        """``stream_*``: the medians of ``repeats`` streamed pushes, each from cold caches."""
        import statistics

        found: dict[str, list[float]] = {k: [] for k in STREAM_KEYS}
        for _ in range(repeats):
            self.side.cold()
            for key, value in self.stream(blocks, [[FIRST_REMOTE, blocks]], layer_s).items():
                found[key].append(value)
        return {f"stream_{k}": round(statistics.median(v), 1) for k, v in found.items()}

    def _stream_case(
        self, tokens: int, nbytes: int, repeats: int, layer_s: float
    ) -> dict[str, Any]:
        """``--stream-only``: the streamed push alone, and what one idle ``poll()`` costs."""
        import statistics

        out: dict[str, Any] = {"tokens": tokens, "kv_bytes": nbytes}
        out.update(self._streamed(tokens // BLOCK_SIZE, repeats, layer_s))
        polls = []
        for _ in range(200):
            t0 = time.perf_counter()
            self.transport.poll()
            polls.append((time.perf_counter() - t0) * 1e6)
        out["idle_poll_us"] = round(statistics.median(polls), 1)
        return out

    def close(self) -> None:
        self.conn.send_bytes(self.msgpack.encode(["stop"]))
        self.side.close()


def main(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    from kvpush.benchmarks import docgen, transport_report

    if args.report:
        return transport_report.report(Path(args.report), args.doc, args.check)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if any(t % BLOCK_SIZE or t <= 0 for t in args.tokens):
        print(f"--tokens must be positive multiples of {BLOCK_SIZE}")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("kvpush bench transport: --device cuda, but torch sees no CUDA device")
            return 2
    setup = make_setup(
        args.device, args.gpu, args.tokens, args.error_mode, args.descriptors == "prepped"
    )
    setup["intervals"] = intervals(args.poll_us, args.device == "cuda")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, setup), daemon=True)
    proc.start()
    bench = None
    try:
        if not parent.poll(120.0):
            raise TimeoutError("decode side did not start")
        bench = _Bench(setup, parent)
        started = time.monotonic()
        layer_s = args.layer_ms / 1e3
        cases = [
            bench.case(tokens, args.repeats, layer_s, args.stream_only) for tokens in args.tokens
        ]
        print(
            f"kvpush bench transport: two processes on {args.device}, UCX error mode "
            f"{args.error_mode}, {args.descriptors} descriptors, median of {args.repeats} "
            f"({time.monotonic() - started:.1f}s, load {os.getloadavg()[0]:.2f})"
        )
        elapsed_s, load = time.monotonic() - started, os.getloadavg()[0]
        settings = {
            "device": args.device,
            "error_mode": args.error_mode,
            "descriptors": args.descriptors,
            "repeats": args.repeats,
            "layer_ms": args.layer_ms,
            "poll_us": poll_us(setup["intervals"]),
        }
        cases = [{**case, **settings} for case in cases]
        if not args.stream_only:
            print(transport_report.table(cases))
        print(transport_report.stream_table(cases))
        if args.json:
            meta = {
                "date": docgen.stamp(),
                "kvpush_rev": docgen.revision(),
                "repeats": args.repeats,
                "elapsed_s": round(elapsed_s, 1),
                "load_avg": round(load, 2),
            }
            document = {"meta": meta, "cases": cases}
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
