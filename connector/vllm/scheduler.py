"""Scheduler half of ``KVPushConnector``: bookkeeping, and the engine's contact point.

Runs inside vLLM's scheduler (the EngineCore thread). It decides, per request, whether KV comes
from a peer (decode: report the prompt's missing tokens as loaded asynchronously), records which
blocks a transfer uses, and hands that to every worker half (one per TP rank) in
``KVPushMetadata`` every step. All bus and NIXL traffic happens in the worker halves
(``worker.py``), which therefore work the same whether they live in this process or others.

It is also what the engine's driver talks to (``kvpush.connector.EngineLink``), and everything
it knows came through vLLM or the wake-up line, never through shared Python state:
- ``ranks``: each rank's ``ConnectorInfo``, from vLLM's handshake-metadata call at start;
- ``activity``: set by ``WakeListener`` whenever a worker half calls ``notify``;
- ``pending()``: transfers not yet reported finished by every rank (vLLM counts the ranks);
- ``suspect_peer``: addresses the driver names go down in the next step's metadata;
- timing marks come up with each step's output (``KVPushWorkerMeta``) and leave on the
  request's final output (``kv_transfer_params``, read back with ``params.timing_of``);
- ``integrity_counts()``: the KV integrity outcomes every rank reported with its step output;
  a receive's own outcome leaves on its request's final output (``INTEGRITY_KEY``).

Decode: the prompt tokens beyond the block-aligned local hit load asynchronously (docs/design.md,
correctness rule 6) into the blocks ``DecodeWork`` names, with an allocation epoch of their own
that P echoes (PUSH or PULL; LOCAL for a request
never loaded; ABORT for one that ended while receiving, whose blocks vLLM keeps until the
receive is reported: correctness rule 3). P's first token comes up with the receive's end
(``_continue``, ``take_prefill_tokens``; docs/connector.md, "The first token from P").
Prefill: a ``PrefillWork`` per scheduled step; a finished request's blocks are freed late until
its push is reported (correctness rule 4; ``has_pending_push_work`` keeps the engine stepping).

Threading model: vLLM calls it on the scheduler thread; an in-process driver calls it from the
engine thread, which is the same thread (``suspect_peer`` takes a lock: it may come from
another). ``WakeListener`` owns one daemon thread that only sets ``activity``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.params import (
    INTEGRITY_KEY,
    TIMING_KEY,
    ConnectorSettings,
    DecodeWork,
    PrefillToken,
    PrefillWork,
    ReceiveKind,
    TransferMode,
    TransferParams,
    first_token_end,
    read_params,
    samples_on_prefill,
)
from kvpush.connector.tracing import emit_span, now_ns
from kvpush.connector.vllm import compat
from kvpush.connector.vllm.metadata import (
    KVPushHandshake,
    KVPushMetadata,
    KVPushWorkerMeta,
    merge_outcomes,
)
from kvpush.connector.vllm.runtime import ConnectorInfo, TimingMarks
from kvpush.connector.vllm.wake import WakeListener
from kvpush.schemas.messages import WorkerRole


class SchedulerHalf:
    def __init__(
        self,
        settings: ConnectorSettings,
        block_size: int,
        engine_id: str,
        max_model_len: int = 1 << 30,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.is_decode = settings.role is WorkerRole.DECODE
        self._wake = WakeListener(engine_id)
        self.activity: threading.Event = self._wake.event
        self.ranks: dict[int, ConnectorInfo] = {}
        self._marks = TimingMarks()
        self._lock = threading.Lock()
        self._suspects: list[str] = []
        self._meta = KVPushMetadata()
        # decode: req_id -> params of receives announced and not yet reported finished
        self._receiving: dict[str, TransferParams] = {}
        self._aborting: set[str] = set()  # decode: ended requests whose receive is not over
        self._handled: set[str] = set()  # decode requests already given a receive or LOCAL
        # decode: one id per block allocation a receive announces (the same on every rank;
        # unique across restarts: it starts at the clock), the KV integrity counts of every
        # rank so far, and each receive's outcome until its request ends
        self._alloc_epochs = itertools.count(time.time_ns() // 1000)
        self._integrity: Counter[str] = Counter()
        self._outcomes: BoundedDict[str, str] = BoundedDict(8192)
        # prefill: req_id -> (params, block ids so far, prompt tokens) while still in prefill
        self._prefilling: dict[str, tuple[TransferParams, list[int], int]] = {}
        self._awaiting_push: set[str] = set()  # finished requests whose blocks wait for a push
        # decode: the requests that asked for P's first token while their KV is on the way
        # (vLLM's Request objects), P's tokens seen for them, and what the driver must report
        self._requests_awaiting_token: dict[str, Any] = {}
        self._prefill_tokens: dict[str, PrefillToken] = {}
        self._tokens_to_report: list[tuple[str, PrefillToken]] = []
        self.driver_takes_tokens = False  # set by the driver that reports them (EngineLink)
        self.free_blocks: Callable[[], int] | None = None  # the driver's view of the pool
        self._block_budget: int | None = None  # free blocks this step's continuations may take
        self.last_step_idle = False  # did the last step schedule no tokens? (an in-process
        # driver then sleeps until the worker half's activity signal instead of stepping again)
        # decode: a long prompt D computes itself was admitted in the step being scheduled
        # (_waits_its_turn)
        self._long_prefill_admitted = False

    # ---- decode side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Decode: the prompt tokens a peer sends (loaded asynchronously), else 0: D computes
        what its prefix cache lacks, or None: not in this step (``_waits_its_turn``)."""
        if not self.is_decode:
            return 0, False
        handled = request.request_id in self._handled
        params = None if handled else read_params(request.kv_transfer_params)
        if params is not None:
            missing = request.num_prompt_tokens - num_computed_tokens
            if missing >= self.settings.min_transfer_tokens:
                return missing, True
            if num_computed_tokens:  # D's own prefix cache: not a fallback (the gateway's outcome)
                self._marks.record(params.transfer_id, kv_cached=now_ns())
        waits = self._waits_its_turn(request.num_tokens - num_computed_tokens)
        # vLLM 0.32 admits a request that reads no prefix cache (prompt_logprobs) whatever it is
        # told: it is then the step's long one, as _waits_its_turn counted it
        if waits and not getattr(request, "skip_reading_prefix_cache", False):
            return None, False
        return 0, False

    def _waits_its_turn(self, uncached: int) -> bool:
        """Whether a prompt D computes itself (``uncached`` tokens its prefix cache lacks) waits
        for the next step: it is long (``serial_prefill_tokens`` or more) and this step already
        admitted a long one. Where each such prefill fills the device's compute alone, one a step
        ends the first sooner and the others about when one batch of all would have; where a
        batch costs little more than one, the others answer later (docs/operating.md)."""
        limit = self.settings.serial_prefill_tokens
        if limit <= 0 or uncached < limit:
            return False
        if self._long_prefill_admitted:
            return True
        self._long_prefill_admitted = True
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not self.is_decode or request.request_id in self._handled:
            return
        params = read_params(request.kv_transfer_params)
        if params is None:
            return
        req_id = request.request_id
        self._handled.add(req_id)
        num_tokens = request.num_prompt_tokens
        allocated_ns = now_ns()
        emit_span(
            "decode.allocate",
            params.traceparent,
            params.received_ns,
            allocated_ns,
            {"kvpush.transfer_id": params.transfer_id, "kvpush.from_peer": num_external_tokens > 0},
        )
        if num_external_tokens <= 0:
            self._meta.decode.append(DecodeWork(ReceiveKind.LOCAL, req_id, params))
            return
        first_token = num_tokens - num_external_tokens
        all_blocks = blocks.get_block_ids()[0]
        first_block = first_token // self.block_size
        last_block = -(-num_tokens // self.block_size)
        kind = ReceiveKind.PULL if params.mode is TransferMode.PULL else ReceiveKind.PUSH
        # P's token continues the request only with a driver that reports it, and only where
        # it gives one engine's answer (the gateway's rule, checked again for any publisher)
        takes = self.driver_takes_tokens and samples_on_prefill(request.sampling_params)
        if params.first_token_from_prefill and takes:
            self._requests_awaiting_token[req_id] = request
        elif params.first_token_from_prefill:  # D samples the first token itself
            params = msgspec.structs.replace(params, first_token_from_prefill=False)
        self._meta.decode.append(
            DecodeWork(
                kind,
                req_id,
                params,
                list(all_blocks[first_block:last_block]),
                first_token,
                num_tokens,
                allocated_ns,
                next(self._alloc_epochs),
            )
        )
        self._receiving[req_id] = params

    def _continue(self, req_id: str, request: Any, token: PrefillToken, tid: str) -> None:
        """P's first token for a request whose KV is in: the answer ends with it, or the
        request continues from it (its last prompt token now: ``compat.continue_from``).
        Either way the driver reports it as the request's first output
        (``take_prefill_tokens``)."""
        end = first_token_end(token, request.max_tokens, request.num_tokens, self.max_model_len)
        if end.finish_reason is None and request.num_tokens % self.block_size == 0:
            # the token's KV opens a block: vLLM admits the request only with one free, and
            # with the pool full and nothing running nothing would free one (recomputing the
            # last prompt token needs no new block): D samples the token itself then
            if self._block_budget is None:  # read once a step, when a block is wanted
                self._block_budget = self.free_blocks() if self.free_blocks is not None else 0
            if self._block_budget <= 0:
                return
            self._block_budget -= 1
        if end.finish_reason is None:
            compat.continue_from(request, token.token_id)
        self._marks.record(tid, prefill_token=now_ns())
        self._tokens_to_report.append((req_id, end))

    def take_prefill_tokens(self) -> list[tuple[str, PrefillToken]]:
        """P's first tokens the driver must report as outputs (request id, token, the answer's
        end), in the order their receives finished (and forget them)."""
        tokens, self._tokens_to_report = self._tokens_to_report, []
        return tokens

    # ---- prefill side ---------------------------------------------------------------------
    def _collect_prefill(self, scheduler_output: Any) -> None:
        """A ``PrefillWork`` for every scheduled step of a kvpush request in prefill."""
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            params = read_params(extra.get("kv_transfer_params"))
            if params is not None and new.prompt_token_ids is not None:
                blocks, num_tokens = list(new.block_ids[0]), len(new.prompt_token_ids)
                self._prefilling[new.req_id] = (params, blocks, num_tokens)
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, done in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if req_id in self._prefilling:
                if new_blocks is not None:
                    self._prefilling[req_id][1].extend(new_blocks[0])
                computed[req_id] = done
        for req_id, done in computed.items():
            params, blocks, num_tokens = self._prefilling[req_id]
            completes = done + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= num_tokens
            work = PrefillWork(req_id, params, list(blocks), num_tokens, completes)
            self._meta.prefill.append(work)
            if completes:
                del self._prefilling[req_id]

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_push)

    # ---- the driver's side -------------------------------------------------------------------
    def set_handshakes(self, handshakes: dict[int, Any]) -> None:
        """vLLM's handshake metadata of every rank, once the KV caches are registered."""
        for rank, handshake in handshakes.items():
            if isinstance(handshake, KVPushHandshake):
                self.ranks[rank] = handshake.info

    def pending(self) -> int:
        """Transfers some rank has not reported finished yet."""
        return len(self._awaiting_push) + len(self._receiving) + len(self._aborting)

    def suspect_peer(self, address: str) -> None:
        """Tell every rank (next step) that the peer at ``address`` may be gone."""
        with self._lock:
            self._suspects.append(address)
        self.activity.set()

    def integrity_counts(self) -> dict[str, int]:
        """Decode: KV integrity outcomes of every rank so far (``integrity.Outcome`` values, and
        ``stale``: notices or bus words of another allocation, dropped)."""
        return dict(self._integrity)

    def take_timing(self, transfer_id: str, keep: bool = False) -> Any:
        """Marks of a transfer that came up after its request finished (vLLM calls
        ``request_finished`` before ``update_connector_output`` in the same step). ``keep``:
        those known so far stay for its end (what D's first output carries: an answer a stop
        string ends is aborted, and its end carries none)."""
        return self._marks.take(transfer_id, keep)

    def shutdown(self) -> None:
        self._wake.close()

    # ---- both ---------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVPushMetadata:
        if not self.is_decode:
            self._collect_prefill(scheduler_output)
        meta, self._meta = self._meta, KVPushMetadata()
        with self._lock:
            meta.suspects, self._suspects = self._suspects, []
        meta.idle_step = scheduler_output.total_num_scheduled_tokens == 0
        self._long_prefill_admitted = False  # the step is scheduled: the next one starts
        self.last_step_idle = meta.idle_step
        return meta

    def update_connector_output(self, output: Any) -> None:
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KVPushWorkerMeta):
            for tid, timings in worker_meta.marks.items():
                for timing in timings:
                    self._marks.record_timing(tid, timing)
            for req_id, token in worker_meta.first_tokens.items():
                if req_id in self._requests_awaiting_token:  # with TP: maybe a step early
                    self._prefill_tokens[req_id] = token
            self._integrity.update(worker_meta.counts)
            merge_outcomes(self._outcomes, worker_meta.outcomes)
        self._block_budget = None
        for req_id in output.finished_recving or ():
            params = self._receiving.pop(req_id, None)
            self._aborting.discard(req_id)
            request = self._requests_awaiting_token.pop(req_id, None)
            token = self._prefill_tokens.pop(req_id, None)
            if params is not None and request is not None and token is not None:
                self._continue(req_id, request, token, params.transfer_id)
        self._awaiting_push.difference_update(output.finished_sending or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        if self.is_decode:
            self._handled.discard(req_id)
            self._requests_awaiting_token.pop(req_id, None)
            self._prefill_tokens.pop(req_id, None)
            params = self._receiving.pop(req_id, None)
            if params is not None:  # ended while its KV was still on the way
                self._meta.decode.append(DecodeWork(ReceiveKind.ABORT, req_id, params))
                self._aborting.add(req_id)
            mine = params or read_params(request.kv_transfer_params)
            outcome = self._outcomes.pop(req_id, None)
            # an aborted request's output (a stop string the detokenizer found, P's token that
            # ended the answer) is already out: its marks stay for the driver (take_timing)
            aborted = getattr(request.status, "name", "") == "FINISHED_ABORTED"
            if mine is None or aborted:
                return False, None
            out: dict[str, Any] = {}
            timing = self._marks.take(mine.transfer_id)
            if timing is not None:
                out[TIMING_KEY] = msgspec.to_builtins(timing)
            if outcome is not None:  # the receive's, and the engine's counts so far
                out[INTEGRITY_KEY] = {"outcome": outcome, "counts": self.integrity_counts()}
            return False, out or None
        self._prefilling.pop(req_id, None)
        if not block_ids or read_params(request.kv_transfer_params) is None:
            return False, None
        self._awaiting_push.add(req_id)
        return True, None
