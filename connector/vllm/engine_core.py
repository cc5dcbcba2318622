"""What the kvpush connector adds to vLLM's engine-core process when the engine runs as
``vllm serve`` runs it (an engine-core process of its own, async scheduling, CUDA graphs).

There the engine's driver (the worker service, holding vLLM's ``AsyncLLM`` client) shares no
Python objects with the connector's scheduler half, so the two things an in-process driver did
through ``kvpush.connector.EngineLink`` happen here, through vLLM's own extension points:

- ``KVPushScheduler`` / ``KVPushAsyncScheduler`` (vLLM's ``Scheduler`` and ``AsyncScheduler``
  with one addition; ``scheduler_cls`` names ``kvpush_scheduler``, which picks the one that
  matches the engine's async scheduling) report the first tokens P sampled: after each
  ``update_from_output`` they put an ``EngineCoreOutput`` with P's token in front of the step's
  outputs, with the prefill statistics vLLM would have put on the request's first output. The
  client's output processor (detokenizer, stop strings) then reads it as the request's first
  token, exactly as the in-process driver's ``first_token.report``. A token that ends the answer
  ends the request here (its timing marks ride on that output); one that does not was made the
  request's last prompt token by the scheduler half (``compat.continue_from``), so the request's
  first step samples the second token. The marks known by then ride on that first output too
  (the driver keeps them): an answer that a stop string ends is aborted by the client's
  detokenizer, so its end brings none.
- On the prefill side the same schedulers send P's first tokens to D themselves, right after
  the step's outputs exist (``token_sender.FirstTokenSender``), not through the worker.
- ``KVPushWorkerExtension`` (``worker_extension_cls``): methods on every rank's vLLM worker that
  the driver calls with ``collective_rpc``: the rank's identity (side channel, for heartbeats),
  its live transfers (drain waits for them), its KV integrity counts (what it sent up to the
  scheduler half: the ranks' sum is the half's ``integrity_counts``), and a peer to suspect (a
  prefill worker whose lease ran out: the decode side probes it). Each returns plain values
  (they cross vLLM's msgpack).

While a step schedules nothing and only transfers are in flight (D waiting for pushed KV, P
for its pushes to end), vLLM's engine-core loop would step again at once, holding the GIL
that the connector's bus thread needs to take in the KV notice and P's token (each hand-off of
the GIL can wait out the switch interval: ``kvpush.connector.switching``). The schedulers
instead wait for the worker half's activity signal (``WakeListener``), ``IDLE_WAIT_S`` at most.

The hand-off costs nothing on the critical path: P's token goes out with the step's own outputs
over vLLM's output socket, one step after the receive's end (as the in-process driver did).

Threading model: the schedulers run on the engine core's busy-loop thread (vLLM's); the worker
extension's methods run on each rank's worker thread between steps (vLLM's ``collective_rpc``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvpush.connector.params import TIMING_KEY, PrefillToken, read_params
from kvpush.connector.vllm.token_sender import FirstTokenSender

FINISHED = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH_CAPPED"}
# The longest idle wait between two steps that schedule nothing (transfers in flight only): a
# request that arrives meanwhile waits at most this long; the connector's signal ends it early.
IDLE_WAIT_S = 0.002


def kvpush_scheduler(*args: Any, **kwargs: Any) -> Any:
    """The engine core's scheduler (vLLM calls ``scheduler_cls`` with the scheduler's own
    arguments): ``KVPushAsyncScheduler`` when vLLM settled on async scheduling (its default
    where supported; only a class named by no one would be picked by vLLM itself), else
    ``KVPushScheduler``."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    overlapped = bool(vllm_config.scheduler_config.async_scheduling)
    return (KVPushAsyncScheduler if overlapped else KVPushScheduler)(*args, **kwargs)


class _PrefillTokens:
    """The mixin of both schedulers: P's first tokens as outputs, and the idle wait (module
    docstring)."""

    connector: Any
    requests: dict[str, Any]
    running: list[Any]
    kv_cache_manager: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._half = getattr(self.connector, "scheduler_half", None)
        self._arrived = False  # a request was added since the last schedule()
        self._news_in_flight = False  # the last idle wait ended on the connector's signal
        self._sender: FirstTokenSender | None = None  # prefill: P's tokens straight to D
        if self._half is not None:  # this scheduler reports P's tokens: D may continue from them
            self._half.driver_takes_tokens = True
            self._half.free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks
            if not self._half.is_decode:
                self._sender = FirstTokenSender(self._half.settings)

    def add_request(self, request: Any) -> None:
        self._arrived = True
        if self._sender is not None:
            self._sender.watch(request)
        super().add_request(request)  # type: ignore[misc]

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.close()
        super().shutdown()  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        half = self._half
        if half is not None and half.last_step_idle and not self.running and not self._arrived:
            # Only transfers are in progress: rather than spin (holding the GIL the connector's
            # bus thread needs to take the KV notice and P's token in), wait for the worker
            # half's activity signal, a moment at most (the engine core reads new requests
            # only between steps). After a signal the next step does not wait: with async
            # scheduling the results of the step that took the news in come out only then.
            if self._news_in_flight:
                self._news_in_flight = False
            else:
                self._news_in_flight = half.activity.wait(IDLE_WAIT_S)
                half.activity.clear()
        self._arrived = False
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._sender is not None:  # prefill: the tokens of this step, to D now
            self._sender.send(outputs)
            self._sender.forget(self.requests)
        if self._half is not None and (tokens := self._half.take_prefill_tokens()):
            self._report(tokens, outputs)
        return outputs

    def _report(self, tokens: list[tuple[str, PrefillToken]], outputs: dict[int, Any]) -> None:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.request import RequestStatus

        ending: dict[str, list[str]] = {}
        for req_id, token in tokens:
            request = self.requests.get(req_id)
            if request is None:  # aborted in the same step
                continue
            ends = token.finish_reason in FINISHED
            stats = request.take_prefill_stats()
            if stats is not None:
                stats.finalize(self.kv_cache_manager.estimate_cached_tokens(request))
            kv_params = None
            if (params := read_params(request.kv_transfer_params)) is not None:
                # the marks so far ride on the first output too: an answer that a stop string
                # ends is aborted by the client's detokenizer, and its end carries none
                timing = self._half.take_timing(params.transfer_id, keep=not ends)
                kv_params = {TIMING_KEY: msgspec.to_builtins(timing)} if timing else None
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[token.token_id],
                finish_reason=FinishReason[token.finish_reason.upper()] if ends else None,
                # a stop string is the detokenizer's to find; a stop token id is the engine's
                stop_reason=token.stop_reason if ends else None,
                kv_transfer_params=kv_params,
                trace_headers=request.trace_headers,
                prefill_stats=stats,
            )
            batch = outputs.setdefault(request.client_index, EngineCoreOutputs())
            batch.outputs.insert(0, output)  # ahead of anything later of the same request
            if ends:
                ending.setdefault(FINISHED[token.finish_reason or ""], []).append(req_id)
        for status, req_ids in ending.items():
            self.finish_requests(req_ids, getattr(RequestStatus, status))  # type: ignore[attr-defined]


class KVPushScheduler(_PrefillTokens, Scheduler):
    """vLLM's ``Scheduler`` that reports P's first tokens (module docstring)."""


class KVPushAsyncScheduler(_PrefillTokens, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` that reports P's first tokens (module docstring)."""


class KVPushWorkerExtension:
    """Methods vLLM mixes into every rank's worker (``worker_extension_cls``); the driver calls
    them with ``collective_rpc``. A rank without a kvpush connector answers empty values."""

    @staticmethod
    def _kvpush_half() -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return None
        return getattr(get_kv_transfer_group(), "worker_half", None)

    def kvpush_rank_info(self) -> dict[str, Any] | None:
        """This rank's ``ConnectorInfo`` as builtins (None before its KV cache is registered)."""
        half = self._kvpush_half()
        info = half.runtime.info if half is not None else None
        return msgspec.to_builtins(info) if info is not None else None

    def kvpush_live_transfers(self) -> int:
        """Transfers this rank's transport still tracks (drain waits for none)."""
        half = self._kvpush_half()
        return half.transport.active() if half is not None and half.transport else 0

    def kvpush_integrity_counts(self) -> dict[str, int]:
        """Decode: the KV integrity counts this rank sent up with its step outputs so far
        (``integrity.Outcome`` values and ``stale``); the scheduler half's counts are the ranks'
        sum, which the driver adds up (``CoreLink.integrity_counts``). Empty on prefill."""
        half = self._kvpush_half()
        return dict(half.integrity_totals) if half is not None else {}

    def kvpush_kv_cache_bytes(self) -> int | None:
        """The KV cache bytes this rank's profiling settled on (None: not profiled, e.g. the
        size was given); the driver remembers them for the next start."""
        value = getattr(self, "available_kv_cache_memory_bytes", None)
        return int(value) if value else None

    def kvpush_redraw_dummy_weights(self) -> None:
        """Redraw this rank's dummy weights (``weights.normal_dummy_weights``; a swap test's
        tool): a function cannot cross to the engine-core process, this method's name can."""
        from kvpush.connector.vllm.weights import normal_dummy_weights

        self.apply_model(normal_dummy_weights)  # type: ignore[attr-defined]

    def kvpush_suspect_peer(self, address: str) -> None:
        """The peer at ``address`` may be gone: the decode side probes it."""
        half = self._kvpush_half()
        if half is not None:
            half.runtime.suspect_peer(address)  # which asks for a step
