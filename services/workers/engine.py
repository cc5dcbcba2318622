"""EngineHost: one vLLM sync ``LLMEngine`` core in this process, driven by one dedicated thread.

Owns the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``InprocClient``, so vLLM's scheduler and
the connector's scheduler half run on the engine thread; no engine-core process, no 1 kHz busy
loop), one ``RequestHandle`` per live request (its ``n`` answers fanned out here, not by vLLM:
``fanout.py``), and a command queue bounded by
``max_queued_commands`` (beyond it ``submit``/``abort``/queries raise RuntimeError). The model
runs in this process too (``executor="uni"``, TP 1) or in vLLM's multiprocess executor
(``executor="mp"``, the only choice for TP > 1): one worker process per TP rank, each with its
own connector worker half, the cores split between ranks (``VLLM_CPU_OMP_THREADS_BIND``).

Threading: vLLM objects live on the thread ``kvpush-engine`` only; other threads queue commands
and set the wake event. The engine thread loops: clear the wake event; run queued commands; if
there is work (requests unfinished, finished but unreported, or held for a delayed free; or
``link.pending() > 0``) run one ``engine.step()`` and route outputs to handles, the first
tokens P sampled (``first_token.report``) ahead of them. With no work
it blocks on the wake event; after an idle step (no tokens scheduled: e.g. every request waits
for remote KV) it waits on it for at most ``idle_wait_s`` (``connector_idle_wait_s`` with a
kvpush connector, which also wakes it at every transfer deadline). With a connector the wake
event *is* the connector's ``link.activity`` (``kvpush.connector.EngineLink``, reached through
the engine), so commands and connector events end the same wait, and as it is cleared before
the step no wake-up is lost: a decode engine waiting for pushed KV sleeps, not spins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvpush.connector import EngineLink, normal_dummy_weights
from kvpush.services.workers import first_token
from kvpush.services.workers.engine_config import (
    EngineConfig,
    engine_kwargs,
    vllm_configs,
    wait_for_gate,
)
from kvpush.services.workers.fanout import Answers, AnswersHost

log = logging.getLogger(__name__)


class EngineHost(AnswersHost):
    """A vLLM engine on its own thread; the module docstring describes the loop."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.sends_first_tokens = False  # the prefill worker sends P's first tokens itself
        self._commands: queue.Queue[Any] = queue.Queue(config.max_queued_commands)  # None: stop
        self.link = EngineLink()  # the engine's connector once built (this one: none)
        self._send_lock = threading.Lock()  # orders sends against the final queue drain
        self._pool: Any = None  # engine thread only, like the engine
        self._scheduler: Any = None
        self._last_executed = True
        self._step_failures = 0

    def _pin(self, env: dict[str, str]) -> None:
        """Only vLLM's multiprocess executor reads VLLM_CPU_OMP_THREADS_BIND (engine_env); in
        process the affinity set here is what pins (OpenMP threads inherit it from the engine
        thread)."""
        if self.config.cpu_cores:
            env["OMP_NUM_THREADS"] = str(len(self.config.cpu_cores))
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):  # a thread that exited meanwhile
                    os.sched_setaffinity(int(task), self.config.cpu_cores)

    def _build(self, report: Callable[[str], None]) -> None:
        cfg = self.config
        started = time.monotonic()
        report("importing vllm")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        report(f"vllm imported ({time.monotonic() - started:.1f} s); building the engine")
        wait_for_gate(cfg, report)  # another engine on the GPU measures its free memory
        kwargs = engine_kwargs(cfg)
        vllm_configs(kwargs, cfg.kv_transfer_config)
        engine = LLMEngine.from_engine_args(
            EngineArgs(**kwargs), usage_context=UsageContext.OPENAI_API_SERVER
        )
        if cfg.load_format == "dummy" and cfg.dummy_weights == "normal":
            report("dummy weights redrawn: normal(0, 0.02) by parameter name, norms 1")
            engine.apply_model(normal_dummy_weights)
        core = engine.engine_core.engine_core  # InprocClient -> EngineCore
        step_fn = core.step_fn

        def step_and_record() -> Any:  # EngineCore.step says whether any token was scheduled
            outputs, executed = step_fn()
            self._last_executed = executed
            return outputs, executed

        core.step_fn = step_and_record
        if cfg.kv_transfer_config:
            self.link = EngineLink.attach(core)  # not connected: another vendor's connector
        self._engine = engine
        self._scheduler = core.scheduler
        self._pool = core.scheduler.kv_cache_manager.block_pool
        self._num_blocks = self._pool.num_gpu_blocks
        if cfg.tp > 1:
            # vLLM's TP embedding masks its input with a torch.compile'd helper: the first step
            # compiles it (a minute on a busy 2-core box). Do that now, not on a user's request.
            report("warming up: the first tensor-parallel step compiles vLLM's embedding helper")
            self._warm_up()
        blocks = self.total_blocks()
        self.last_free_blocks = self._pool.get_num_free_blocks()
        report(f"engine ready ({time.monotonic() - started:.1f} s, {blocks} blocks)")

    def _warm_up(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        self._engine.add_request(
            "kvpush-warmup", tokens_input([1, 2, 3]), SamplingParams(max_tokens=1)
        )
        while self._engine.has_unfinished_requests():
            self._engine.step()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, shut the engine down, join the thread. Idempotent."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(None, timeout=timeout)  # the stop marker, not via _send
        self.link.activity.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine thread still running %.0f s after stop", timeout)

    def free_blocks(self, timeout: float = 30.0) -> int:
        """Blocks a new request can get now: free ones plus cached ones nobody references
        (asks the engine thread; ``last_free_blocks`` is the count without waiting for it)."""
        return int(self.call(lambda _engine: self._pool.get_num_free_blocks(), timeout))

    def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Drop the prefix cache; False (and a vLLM warning) while any block is in use."""
        return bool(self.call(lambda engine: engine.reset_prefix_cache(), timeout))

    def call(self, fn: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self._engine)
        return self._send(lambda: fn(self._engine)).result(timeout)

    def _send(self, command: Callable[[], Any]) -> Future[Any]:
        """Queue ``command`` for the engine thread; the future gets its result or exception."""
        future: Future[Any] = Future()
        with self._send_lock:  # commands queued before stop() still run
            if not self._accepting:
                raise RuntimeError("EngineHost is not running")
            try:
                self._commands.put_nowait((command, future))
            except queue.Full:
                raise RuntimeError("EngineHost command queue is full") from None
        self.link.activity.set()
        return future

    _dispatch = _send

    def _run(self, report: Callable[[str], None]) -> None:
        if not self._built(lambda: self._build(report)):
            return
        wake = self.link.activity
        # A kvpush connector wakes us for everything a step must act on (a transfer's end, its
        # deadline, a message, an abort's timeout): idle steps would only cost CPU (and keep
        # vLLM's multiprocess workers spinning: their queue busy-waits 1 s after each step).
        cfg = self.config
        idle_wait_s = cfg.connector_idle_wait_s if self.link.connected else cfg.idle_wait_s
        try:
            while True:
                wake.clear()  # anything set from here on ends the waits below at once
                if self._run_commands():
                    return
                self.last_free_blocks = self._pool.get_num_free_blocks()
                # has_requests(): also finished-but-unreported and delayed-free requests
                busy = self._engine.has_unfinished_requests() or self._scheduler.has_requests()
                if not (busy or self.link.pending() > 0):
                    wake.wait(1.0)
                elif self._step():
                    self.idle_steps += 1
                    wake.wait(idle_wait_s)
        except BaseException:
            log.exception("engine loop crashed")
        finally:
            self._shutdown()

    def _run_commands(self) -> bool:
        """Run every queued command; True when the stop marker came."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            command, future = item
            try:
                future.set_result(command())
            except Exception as exc:
                log.exception("engine command failed")
                future.set_exception(exc)

    def _add_answer(self, answers: Answers, engine_id: str, params: Any) -> None:
        self._engine.add_request(engine_id, answers.prompt, params)
        self._answers[engine_id] = answers

    def _abort_answers(self, engine_ids: list[str]) -> None:
        self._engine.abort_request(engine_ids)

    def _step(self) -> bool:
        """One engine step; True when it was idle (scheduled no tokens, or failed)."""
        self._last_executed = False
        try:
            outputs = self._engine.step()
            if tokens := self.link.take_prefill_tokens():  # before the step that continues them
                outputs = [*first_token.report(self._engine, tokens), *outputs]
        except Exception as exc:
            self._step_failures += 1
            log.exception("engine step failed; failing %s", sorted(self._requests))
            self._abort_all("error", f"engine step failed: {exc!r}")
            if self._step_failures >= 3:
                raise  # the engine is broken: stop the host
            time.sleep(self.config.idle_wait_s)  # then retry at once (the set wake event)
            self.link.activity.set()
            return True
        self._step_failures = 0
        self.steps += 1
        self.last_free_blocks = self._pool.get_num_free_blocks()
        for out in outputs:
            self._route(out)
        return not self._last_executed or self.link.last_step_idle()

    def _shutdown(self) -> None:
        with self._send_lock:
            self._accepting = False
        while self._run_commands():  # commands queued before the stop still run
            pass
        self._abort_all("abort", "engine stopped")
        try:
            self._engine.engine_core.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
