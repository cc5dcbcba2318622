"""The transport benchmark's prefill side (``kvpush bench transport``, ``transport.py``): the
timed operations of one case, each against the decode side that ``transport_side.decode_side``
runs in a spawned child and answers over a pipe (``ctl``).

``PrefillBench`` owns this process's KV pool and transport (``transport_side.Side``), the raw
NIXL agent of the ``raw`` cases and the pipe; ``case`` verifies each operation byte-exact once,
then times every operation ``repeats`` times from cold caches (``Side.cold``) and returns the
medians: the push as the connector posts it (per layer, one request, fragmented), the pull,
raw single-descriptor WRITEs and READs, a memcpy, and the streamed push (``stream``: the
announcement first, each layer pushed once computed, both sides driven by ``Poller``s).

Threading model: the benchmark's main thread; ``stream`` adds the poller's thread and, on
CUDA, the layer gate's (``connector.LayerGate``), which post and report as they do in a
worker.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from kvpush.benchmarks.transport_side import BLOCK_SIZE, FIRST_REMOTE, Side

STREAM_KEYS = ("forward_us", "post_us", "p_tail_us", "d_tail_us")


class PrefillBench:
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
