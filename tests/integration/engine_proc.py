"""Two-engine harness: each ``EngineProc`` runs one ``EngineHost`` in a spawned child process.

pytest never imports vllm itself; every engine lives in a child started with multiprocessing
"spawn" and driven through a pipe. Requests are plain dicts (``request_id``,
``prompt_token_ids``, ``sampling`` (SamplingSpec fields), optional ``kv_transfer_params`` and
``cache_salt``), passed through unchanged, so the same harness drives P/D connector tests.

Threading model: the child's main thread reads commands and answers quick ones itself;
blocking ones (``collect``, ``wait_tokens``) get a thread each, so an ``abort`` is never stuck
behind a ``collect``. In the parent one reader thread matches replies to callers by sequence
number, so ``EngineProc`` methods may be called from several threads. Lifetime: the child
exits when the pipe closes or its parent pid changes (parent gone, checked every 0.5 s);
``stop`` kills it after a timeout, and an atexit hook kills any child still running.

Factories for the fixtures in conftest: ``start_engine`` (one engine, pinned), and the core
assignment ``P_CORES``/``D_CORES`` (P and D never share a core).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvpush.connector import timing_of
from kvpush.services.workers.engine import EngineConfig

P_CORES = [0]
D_CORES = [1]
_LIVE: weakref.WeakSet[EngineProc] = weakref.WeakSet()


# ---- child -------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Exit as soon as the parent process is gone (even while the engine is still building).

    Not PR_SET_PDEATHSIG: that fires when the parent *thread* that spawned us exits, and tests
    may start engines from short-lived threads.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _output_dict(out: Any, handle: Any) -> dict[str, Any]:
    first, done = handle.first_output_at, handle.finished_at
    return {
        "request_id": out.request_id,
        "token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "error": out.error,
        "kv_transfer_params": out.kv_transfer_params,
        "num_cached_tokens": out.num_cached_tokens,
        # per token: candidate id -> log-probability (what tests/gpu/gpu_swap.py compares)
        "logprobs": None
        if out.logprobs is None
        else [{c.token_id: c.logprob for c in pos} for pos in out.logprobs],
        "first_output_s": None if first is None else first - handle.submitted_at,
        "total_s": None if done is None else done - handle.submitted_at,
        "submitted_at": handle.submitted_at,  # time.monotonic(): one clock for every process
        "kv_landed_ns": 0,  # set by collect: when D's connector had the moved KV (0: it did not)
        "prefill_token_ns": 0,  # ... and when it took up P's first token (0: D sampled it)
    }


def _failed(request_id: str, error: str) -> dict[str, Any]:
    """A result for a request that has no output: same keys as ``_output_dict``."""
    return {
        "request_id": request_id,
        "token_ids": [],
        "text": "",
        "finish_reason": None,
        "stop_reason": None,
        "error": error,
        "kv_transfer_params": None,
        "num_cached_tokens": None,
        "logprobs": None,
        "first_output_s": None,
        "total_s": None,
        "submitted_at": None,
        "kv_landed_ns": 0,
        "prefill_token_ns": 0,
    }


def _child(conn: Any, config: EngineConfig, log_path: str | None) -> None:
    _die_with_parent()
    if log_path:  # vLLM logs to stdout/stderr: keep them out of the test's output
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import msgspec

    from kvpush.schemas.messages import SamplingSpec
    from kvpush.services.workers.core_engine import engine_host

    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    host = engine_host(config)  # config.engine_core: this process's thread, or a process
    started = time.monotonic()
    try:
        host.start(progress=lambda msg: send("progress", msg))
    except BaseException as exc:
        send("failed", repr(exc))
        return
    send(
        "ready",
        {
            "total_blocks": host.total_blocks(),
            "start_s": time.monotonic() - started,
            "connector": msgspec.to_builtins(host.link.info) if host.link.info else {},
            "ranks": [msgspec.to_builtins(info) for info in host.link.ranks],
        },
    )
    handles: dict[str, Any] = {}
    transfer_of: dict[str, str] = {}  # request id -> its transfer id (kv_transfer_params)

    def collect(seq: int, ids: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        results = []
        for rid in ids:
            handle = handles.get(rid)
            if handle is None:
                results.append(_failed(rid, "unknown request_id"))
                continue
            try:
                out = handle.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                results.append(_failed(rid, f"timeout after {timeout} s"))
                continue
            handles.pop(rid, None)
            results.append(_output_dict(out, handle))
            tid = transfer_of.pop(rid, None)
            # as the decode worker reads them: on the final output, or (an answer that ended by
            # an abort the engine made itself: a stop string) kept for the driver
            marks = timing_of(out.kv_transfer_params) or (tid and host.link.take_timing(tid))
            results[-1]["kv_landed_ns"] = marks.kv_landed if marks else 0
            results[-1]["prefill_token_ns"] = marks.prefill_token if marks else 0
        send("reply", seq, True, results)

    def wait_tokens(seq: int, rid: str, count: int, timeout: float) -> None:
        handle = handles.get(rid)
        if handle is None:
            send("reply", seq, False, f"unknown request_id {rid}")
            return
        seen = [0]
        enough = threading.Event()

        def watch() -> None:  # the blocking iterator has no timeout: watch on a side thread
            for out in handle:
                seen[0] += len(out.token_ids)
                if seen[0] >= count or out.finished:
                    break
            enough.set()

        threading.Thread(target=watch, daemon=True).start()
        enough.wait(timeout)
        send("reply", seq, True, seen[0])

    def run(op: str, args: dict[str, Any]) -> Any:
        if op == "submit":
            ids = []
            for req in args["requests"]:
                rid = req["request_id"]
                handles[rid] = host.submit(
                    rid,
                    req["prompt_token_ids"],
                    msgspec.convert(req.get("sampling", {}), SamplingSpec),
                    kv_transfer_params=req.get("kv_transfer_params"),
                    cache_salt=req.get("cache_salt"),
                )
                params = (req.get("kv_transfer_params") or {}).get("kvpush") or {}
                if params.get("transfer_id"):
                    transfer_of[rid] = params["transfer_id"]
                ids.append(rid)
            return ids
        if op == "abort":
            return host.abort(args["request_id"])
        if op == "free_blocks":
            return host.free_blocks()
        if op == "reset_prefix_cache":
            return host.reset_prefix_cache()
        if op == "integrity_counts":  # the link's (an engine-core process: over collective_rpc)
            return host.link.integrity_counts()
        if op == "stats":
            return {
                "steps": host.steps,
                "idle_steps": host.idle_steps,
                "cpu_s": time.process_time(),
            }
        raise ValueError(f"unknown op {op}")

    try:
        while True:
            try:
                seq, op, args = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if op == "stop":
                host.stop()
                send("reply", seq, True, None)
                break
            if op == "collect":
                call = (seq, args["ids"], args["timeout"])
                threading.Thread(target=collect, args=call, daemon=True).start()
                continue
            if op == "wait_tokens":
                call = (seq, args["rid"], args["count"], args["timeout"])
                threading.Thread(target=wait_tokens, args=call, daemon=True).start()
                continue
            try:
                send("reply", seq, True, run(op, args))
            except Exception as exc:
                send("reply", seq, False, repr(exc))
    finally:
        host.stop()
        conn.close()  # then a normal exit (os._exit would leak a semaphore warning)


# ---- parent ------------------------------------------------------------------------------
class EngineProc:
    """Parent-side handle of one engine process. Methods block; any thread may call them."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        log_path: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.log_path = str(log_path) if log_path else None
        self.progress = progress or (lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True))
        self.start_s = 0.0
        self._total_blocks = 0
        self._proc: Any = None
        self._conn: Any = None
        self._ready: Future[dict[str, Any]] = Future()
        self._pending: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._reader: threading.Thread | None = None
        self._closed = False  # set by the reader when the child is gone

    def start(self, timeout: float = 300.0) -> EngineProc:
        """Spawn the child, build its engine, return when ready (raises with the log tail)."""
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child,
            args=(child_conn, self.config, self.log_path),
            name=f"engine-{self.name}",
            # vLLM starts a process per rank (TP > 1) or an engine-core process from it
            daemon=self.config.tp == 1 and self.config.engine_core == "thread",
        )
        started = time.monotonic()
        self._proc.start()
        child_conn.close()
        _LIVE.add(self)
        self._reader = threading.Thread(target=self._read, name=f"engine-{self.name}-reader")
        self._reader.daemon = True
        self._reader.start()
        try:
            ready = self._ready.result(timeout)
        except Exception as exc:
            self.kill()
            raise RuntimeError(f"engine {self.name} did not start: {exc}{self._tail()}") from exc
        self._total_blocks = ready["total_blocks"]
        self.connector_info: dict[str, str] = ready["connector"]  # side_channel, compat_hash...
        self.ranks: list[dict[str, Any]] = ready["ranks"]  # every TP rank's connector info
        self.start_s = time.monotonic() - started
        self.progress(f"ready in {self.start_s:.1f} s ({ready['total_blocks']} blocks)")
        return self

    def _read(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "progress":
                self.progress(rest[0])
            elif kind == "ready":
                self._ready.set_result(rest[0])
            elif kind == "failed":
                self._ready.set_exception(RuntimeError(rest[0]))
            elif kind == "reply":
                seq, ok, value = rest
                with self._lock:
                    future = self._pending.pop(seq, None)
                if future is not None:
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(RuntimeError(f"engine {self.name}: {value}"))
        gone = RuntimeError(f"engine process {self.name} exited{self._tail()}")
        if not self._ready.done():
            self._ready.set_exception(gone)
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(gone)

    def _call(self, op: str, wait_s: float = 60.0, **args: Any) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed or self._conn is None:
                raise RuntimeError(f"engine process {self.name} is not running")
            seq = next(self._seq)
            self._pending[seq] = future
            self._conn.send((seq, op, args))
        return future.result(wait_s)

    def _tail(self, lines: int = 30) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        return "\n--- log tail ---\n" + "\n".join(text)

    # ---- requests --------------------------------------------------------------------
    def submit(self, requests: list[dict[str, Any]]) -> list[str]:
        """Submit all requests (not waiting for them); returns their ids."""
        return self._call("submit", requests=requests)

    def collect(self, request_ids: list[str], timeout: float = 120.0) -> list[dict[str, Any]]:
        """Wait for the given requests; results in the same order (``error`` set on timeout)."""
        return self._call("collect", timeout + 10, ids=request_ids, timeout=timeout)

    def generate(self, requests: list[dict[str, Any]], timeout: float = 120.0) -> list[dict]:
        """Submit all requests concurrently and wait for all of them."""
        return self.collect(self.submit(requests), timeout)

    def wait_tokens(self, request_id: str, count: int = 1, timeout: float = 60.0) -> int:
        """Block until the request produced ``count`` tokens or finished; returns tokens seen."""
        return self._call("wait_tokens", timeout + 10, rid=request_id, count=count, timeout=timeout)

    def abort(self, request_id: str) -> None:
        self._call("abort", request_id=request_id)

    def free_blocks(self) -> int:
        return self._call("free_blocks")

    def total_blocks(self) -> int:
        return self._total_blocks

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def integrity_counts(self) -> dict[str, int]:
        """The engine's KV integrity counts as its driver reads them (``link.integrity_counts``)."""
        return self._call("integrity_counts")

    def stats(self) -> dict[str, Any]:
        """Engine steps, idle steps, and the child's CPU seconds so far."""
        return self._call("stats")

    # ---- lifetime --------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine cleanly; kill the process if it does not exit within ``timeout``."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self._call("stop", timeout)
            except Exception as exc:
                self.progress(f"stop failed ({exc!r}); killing")
            self._proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine process and every process it started (vLLM's per-rank workers
        outlive their parent for a while otherwise, and would finish what they were doing)."""
        if self._proc is not None and self._proc.is_alive():
            for pid in _descendants(self._proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        _LIVE.discard(self)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children before their parents' siblings."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


@atexit.register
def _kill_all() -> None:
    for proc in list(_LIVE):
        proc.kill()


def engine_config(model_dir: str | Path, cores: list[int], **overrides: Any) -> EngineConfig:
    """The test engine: tiny limits, pinned to ``cores``; ``overrides`` are EngineConfig fields."""
    base = EngineConfig(model_dir=str(model_dir), max_model_len=4096, cpu_cores=list(cores))
    return dataclasses.replace(base, **overrides)


def start_engine(
    name: str,
    model_dir: str | Path,
    cores: list[int],
    log_dir: str | Path | None = None,
    **overrides: Any,
) -> EngineProc:
    """Start one engine process (``name``, pinned to ``cores``) and wait until it is ready.

    For P/D tests: ``start_engine("P", model, P_CORES, kv_transfer_config={...})`` and
    ``start_engine("D", model, D_CORES, ...)``. vLLM's own log goes to ``log_dir/<name>.log``.
    """
    log_path = Path(log_dir) / f"{name}.log" if log_dir else None
    return EngineProc(name, engine_config(model_dir, cores, **overrides), log_path).start()
