"""The gateway's cost model: an estimated time to first token for each way to serve a prompt.

``CostModel`` learns from what the gateway already sees and nothing else:

- per worker, EWMAs of its **prefill rate** (prompt tokens it computed / the time it took),
  its **service time** (what one prefill costs it: the wait a request queued behind it pays)
  and, for D, its **step time** (KV landed -> first token), from each finished request's
  ``Timing`` (the last TokenChunk's, see ``services.telemetry.breakdown``): P's
  ``prefill_start -> prefill_end`` for push and pull (tokens: the prompt less P's prefix hit
  when the request was routed); D's ``decode_received -> first_token`` for LOCAL (tokens: the
  prompt less the final chunk's ``num_cached_tokens``), only from a request routed with nothing
  queued (``wait_local`` charges waits already) and nothing decoding on D, and ``kv_landed ->
  first_token`` for push and pull (step time); D's **join time**: what each request decoding on
  D added to a LOCAL prompt's time past its compute (routed with nothing queued: ``(time -
  compute) / running``, at least 0; until measured, the step time);
- the **KV transfer**: bytes/s and bytes per token from each ``KvPushed`` (``bytes / push_ms``,
  ``bytes / num_tokens``), the share of a push that is not hidden behind P's compute (its
  ``timing``: ``(kv_sent - prefill_end) / push_ms``), and for pull the READ of a finished
  request (``prefill_end -> kv_sent``, D's prefix hit's tokens excluded);
- the **hand-off**, fixed per disaggregated request: an EWMA of its bus and announce parts
  (``published -> prefill_received`` plus ``kv_sent -> kv_landed``), and of LOCAL's bus hop
  (``published -> decode_received``).

Until measured, each value is its ``PRIOR_*`` constant; an unmeasured worker takes the fleet's
EWMA (every sample of that kind) before the prior. ``warm`` says whether there are measurements
enough to trust a comparison of modes (``WARM_SAMPLES`` prefill samples, P's or D's: the
transfer keeps its prior until one is measured, so a router whose idle D computes every prompt
still warms up);
while cold, the router keeps the deployment's fixed rule for the mode (``--local-threshold``).

Estimates (``estimate(candidate)``, milliseconds, with their terms)::

    LOCAL on D      = local_overhead + wait_local(D) + device(D) + compute(D, prompt - hit(D))
    PUSH  P -> D    = handoff + max(wait(P) + device(P) + compute(P, prompt - hit(P))
                                    + push_tail_share * transfer(prompt - hit(D)),
                                    waiting(D) * service_ms(D) + device(D))
                      + steps(D)
                      (P on D's own device: not the max but P's side alone, which holds
                      D's waiting prefills in device(P): the two take turns on its compute)
    PULL  P -> D    = the same with the whole transfer (D READs after P's prefill)
    wait(W)         = load(W) * service_ms(W)   (heartbeat in_flight + sent since - ended since)
    device(W)       = the queued compute of the other engines on W's device (heartbeats'
                      ``gpu``: a GPU, or a CPU engine's pinned cores; "": none, 0): each
                      one's queued prefills (a P's load, a D's waiting(D)) x its service_ms
    wait_local(D)   = (load(D) - running(D)) * service_ms(D) + running(D) * join_ms(D)
                      (load - running: D's LOCAL requests not past their first token, by
                      its heartbeat's queue_depth and what the gateway saw since (sent,
                      started: ``worker_registry.WorkerState.waiting``); a push/pull request
                      waiting for its KV is running: a step once the KV lands, not a prefill)
    steps(D)        = (1 + running(D)) * step_ms(D)
    transfer(n)     = n * bytes_per_token / bytes_per_s

D needs only the blocks it lacks: D's connector announces (push) or READs (pull) the prompt's
tokens past its own block-aligned prefix hit (``connector/vllm/scheduler.py``), so a prefix hit
on D shrinks the transfer: that is prefix-partial push. P computes what its own prefix cache
lacks. A LOCAL request waits a service time behind each of D's prefills, and a join time for
each request D runs (vLLM batches a new prompt with the running decodes). A transfer waits on
P's load and, on D, for D's waiting prefills only past the time P takes (they run while P
computes) and for steps. Engines on one device take turns on its compute (one GPU's SMs, or the
cores two CPU engines are pinned to): a prefill waits for the prefills queued on every engine
of its device (``device_sums``, ``device_share``). docs/operating.md ("Routing") says why each
term is what it is, with the measurements that made it so.

The estimate splits into a P part and a D share (``prefill_parts``; ``decode_parts``: LOCAL's
estimate and the transfer share, each over the workers' ``view``, load and prompt tokens missing
from their prefix cache): a transfer's total is ``share.total(P part)``, which grows with the P
part, so the cheapest pair is the cheapest P with the D whose share is cheapest for it, and the
router finds it in O(P + D) rather than O(P * D) (for a D on that P's GPU: that P in turns, or
the cheapest P elsewhere; ``route_choice.choose``).

Threading model: the gateway's event loop only (learning and estimating); no locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Final

from kvpush.connector import BoundedDict
from kvpush.schemas.messages import KvPushed, Timing, TransferMode
from kvpush.services.gateway.cost_terms import (
    EWMA_WEIGHT,
    Candidate,
    DecodeRow,
    Estimate,
    Ewma,
    PrefillRow,
    ShareTerms,
    TransferShare,
    WorkerView,
    measured_of,
)

__all__ = [
    "EWMA_WEIGHT",
    "Candidate",
    "CostModel",
    "DecodeRow",
    "Estimate",
    "PrefillRow",
    "ShareTerms",
    "TransferShare",
    "WorkerView",
]

PRIOR_PREFILL_TOKENS_PER_S: Final = 20_000.0
"""Prompt tokens per second a worker prefills before any is measured (an 8B model on one H200
prefills 8k tokens in ~0.2 s; a CPU box's tiny model is faster, so priors favour disaggregating
long prompts there less than measurements will)."""
PRIOR_SERVICE_MS: Final = 20.0
"""What one queued request costs a worker before its first step is measured."""
PRIOR_TRANSFER_BYTES_PER_S: Final = 10e9
"""KV transfer rate before a push or pull is measured (NIXL over NVLink/RDMA: ~10 GB/s)."""
PRIOR_BYTES_PER_TOKEN: Final = 131_072.0
"""KV bytes per prompt token (Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 x 2)."""
PRIOR_PUSH_TAIL_SHARE: Final = 0.25
"""The share of a push's transfer time left after P's compute ends (layers push as they go)."""
PRIOR_STEP_MS: Final = 5.0
"""D's step from the KV landing to the first token, before it is measured."""
PRIOR_HANDOFF_MS: Final = 2.0
"""Bus hops and block announcement of a disaggregated request."""
PRIOR_LOCAL_OVERHEAD_MS: Final = 0.5
"""The bus hop of a LOCAL request to D."""
WARM_SAMPLES: Final = 3
"""Prefill-rate samples needed before modes are compared by cost."""
MAX_WORKERS: Final = 4096
"""Workers whose measurements are kept (the oldest measured are dropped past it)."""


@dataclass(slots=True)
class WorkerCosts:
    """One worker's measurements."""

    tokens_per_s: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    service_ms: Ewma = field(default_factory=lambda: Ewma(PRIOR_SERVICE_MS))
    step_ms: Ewma = field(default_factory=lambda: Ewma(PRIOR_STEP_MS))
    join_ms: Ewma = field(default_factory=lambda: Ewma(PRIOR_STEP_MS))  # unmeasured: step_ms


class CostModel:
    """Learned costs and the estimates made of them; see the module docstring."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.workers: BoundedDict[str, WorkerCosts] = BoundedDict(max_workers)
        self.fleet = WorkerCosts()  # every worker's samples: the unmeasured workers' estimate
        self.bytes_per_s = Ewma(PRIOR_TRANSFER_BYTES_PER_S)
        self.bytes_per_token = Ewma(PRIOR_BYTES_PER_TOKEN)
        self.push_tail_share = Ewma(PRIOR_PUSH_TAIL_SHARE)
        self.handoff_ms = Ewma(PRIOR_HANDOFF_MS)
        self.local_overhead_ms = Ewma(PRIOR_LOCAL_OVERHEAD_MS)
        self._views: dict[str, WorkerView] = {}  # memo of ``view``: emptied by every sample

    @property
    def warm(self) -> bool:
        """Measured enough to compare modes by cost (else the router's fixed rule decides)."""
        return self.fleet.tokens_per_s.samples >= WARM_SAMPLES

    # ---- estimates -------------------------------------------------------------------------
    def view(self, worker_id: str) -> WorkerView:
        """``worker_id``'s rates for the estimates (memoized until the next sample)."""
        found = self._views.get(worker_id)
        if found is not None:
            return found
        own, fleet = self.workers.get(worker_id), self.fleet
        rate = measured_of(own.tokens_per_s if own else None, fleet.tokens_per_s)
        service = measured_of(own.service_ms if own else None, fleet.service_ms)
        step = measured_of(own.step_ms if own else None, fleet.step_ms).value
        join = measured_of(own.join_ms if own else None, fleet.join_ms)
        found = WorkerView(  # the join time is the step time until one is measured
            1000.0 / rate.value, service.value, step, join.value if join.samples else step
        )
        if len(self._views) >= self.workers.limit:
            self._views.clear()
        self._views[worker_id] = found
        return found

    def compute_ms(self, worker_id: str, tokens: int) -> float:
        return max(tokens, 0) * self.view(worker_id).ms_per_token

    def wait_ms(self, worker_id: str, load: int) -> float:
        return load * self.view(worker_id).service_ms

    def steps_ms(self, decode_id: str, running: int) -> float:
        return (1 + running) * self.view(decode_id).step_ms

    def transfer_ms(self, tokens: int) -> float:
        return max(tokens, 0) * self.bytes_per_token.value * 1000.0 / self.bytes_per_s.value

    def _tail_share(self, mode: TransferMode) -> float:
        return self.push_tail_share.value if mode is TransferMode.PUSH else 1.0

    def device_sums(
        self,
        prefills: Iterable[PrefillRow],
        p_devices: Iterable[str],
        decodes: Iterable[DecodeRow],
        d_devices: Iterable[str],
    ) -> dict[str, float]:
        """Per device (heartbeats' ``gpu``; "" left out), the queued compute of its engines, in
        ms of each one's service time: each P's load and each D's waiting LOCAL prefills. A
        worker's ``device(W)`` is its device's sum less its own (``device_share.others``)."""
        memo, view = self._views, self.view  # the memo read inline: asked of every worker
        sums: dict[str, float] = {}
        for (worker_id, load, _), device in zip(prefills, p_devices, strict=False):
            if device and load > 0:
                own = load * (memo.get(worker_id) or view(worker_id)).service_ms
                sums[device] = sums.get(device, 0.0) + own
        for (worker_id, load, run, _), device in zip(decodes, d_devices, strict=False):
            if device and load > run:
                own = (load - run) * (memo.get(worker_id) or view(worker_id)).service_ms
                sums[device] = sums.get(device, 0.0) + own
        return sums

    def prefill_parts(
        self,
        prefills: Iterable[PrefillRow],
        devices: Iterable[str] | None = None,
        sums: Mapping[str, float] | None = None,
    ) -> list[float]:
        """Each P's share of a push/pull estimate: its wait, the other queued compute on its
        device (``devices`` each P's, ``sums`` ``device_sums``'s; None: none) and its compute.
        Per P: its id (its ``view``), its load and the prompt tokens its prefix cache lacks."""
        memo, view = self._views, self.view  # the memo read inline: asked of every P
        if sums is None or devices is None:
            return [
                load * (w := memo.get(worker_id) or view(worker_id)).service_ms
                + tokens * w.ms_per_token
                for worker_id, load, tokens in prefills
            ]
        return [
            (own := load * (w := memo.get(worker_id) or view(worker_id)).service_ms)
            + (sums.get(device, 0.0) - own if device else 0.0)
            + tokens * w.ms_per_token
            for (worker_id, load, tokens), device in zip(prefills, devices, strict=True)
        ]

    def decode_parts(
        self,
        transfer: TransferMode | None,
        decodes: Iterable[DecodeRow],
        devices: Iterable[str] | None = None,
        sums: Mapping[str, float] | None = None,
    ) -> tuple[list[float], list[ShareTerms]]:
        """Each D's LOCAL estimate and, for a ``transfer`` mode (push or pull; None: none), its
        share of that mode's estimate (the hand-off, the transfer's tail of what D lacks, D's
        waiting prefills with its device's other queued compute, and its steps: a
        ``TransferShare``'s fields, as a plain tuple), in one pass. Per D: its id (its
        ``view``), its load, its requests past their first token (part of its load) and the
        prompt tokens its prefix cache lacks (at least 0); ``devices`` and ``sums`` as
        ``prefill_parts`` reads them (None: none)."""
        memo, view = self._views, self.view  # the memo read inline: asked of every D
        base = self.local_overhead_ms.value
        handoff = self.handoff_ms.value
        tail_per_token = (
            0.0 if transfer is None else self._tail_share(transfer) * self.transfer_ms(1)
        )
        parts: list[float] = []
        shares: list[ShareTerms] = []
        for (worker_id, load, run, tokens), device in zip(
            decodes, repeat("") if devices is None else devices, strict=False
        ):
            ms_per_token, service_ms, step_ms, join_ms = memo.get(worker_id) or view(worker_id)
            # D's waiting prefills: max(0, load - run) of them, without a call per D
            waiting = (load - run if load > run else 0) * service_ms
            others = sums.get(device, 0.0) - waiting if device and sums else 0.0
            parts.append(base + waiting + others + run * join_ms + tokens * ms_per_token)
            if transfer is not None:
                fixed = handoff + (1 + run) * step_ms
                shares.append((fixed, tokens * tail_per_token, waiting + others))
        return parts, shares

    def estimate(self, c: Candidate) -> Estimate:
        """``c``'s estimated TTFT (ms) and its terms; see the module docstring."""
        terms: dict[str, float] = {}
        if c.prefill_id is None or c.mode is TransferMode.LOCAL:
            terms["overhead"] = self.local_overhead_ms.value
            waiting = max(0, c.decode_load - c.decode_running)  # as decode_parts counts it
            terms["wait_d"] = self.wait_ms(c.decode_id, waiting)
            terms["device_d"] = c.decode_device_ms
            terms["decoding_d"] = c.decode_running * self.view(c.decode_id).join_ms
            terms["compute_d"] = self.compute_ms(c.decode_id, c.prompt_tokens - c.decode_hit)
        else:
            terms["handoff"] = self.handoff_ms.value
            terms["wait_p"] = self.wait_ms(c.prefill_id, c.prefill_load)
            terms["device_p"] = c.prefill_device_ms
            terms["compute_p"] = self.compute_ms(c.prefill_id, c.prompt_tokens - c.prefill_hit)
            moved = c.prompt_tokens - c.decode_hit
            terms["transfer"] = self._tail_share(c.mode) * self.transfer_ms(moved)
            # D's waiting prefills and its device's queue, past what P and the tail take
            # (TransferShare.total); on P's device they are in device_p (TransferShare.in_turns)
            waiting = self.wait_ms(c.decode_id, max(0, c.decode_load - c.decode_running))
            waiting += c.decode_device_ms
            overlapped = sum(terms[k] for k in ("wait_p", "device_p", "compute_p", "transfer"))
            terms["wait_d"] = 0.0 if c.shared_gpu else max(0.0, waiting - overlapped)
            terms["steps_d"] = self.steps_ms(c.decode_id, c.decode_running)
        return Estimate(c, sum(terms.values()), terms)

    # ---- learning --------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> WorkerCosts:
        self._views.clear()  # a sample of it (or the fleet's) comes
        costs = self.workers.get(worker_id)
        if costs is None:
            costs = self.workers[worker_id] = WorkerCosts()
        return costs

    def _prefilled(self, worker_id: str, tokens: int, start_ns: int, end_ns: int) -> None:
        """``worker_id`` computed ``tokens`` prompt tokens between the two instants."""
        if not start_ns or end_ns <= start_ns:
            return
        ms = (end_ns - start_ns) / 1e6
        own = self._worker(worker_id)
        for costs in (own, self.fleet):
            costs.service_ms.update(ms)
            if tokens > 0:
                costs.tokens_per_s.update(tokens * 1000.0 / ms)

    def _joined(
        self, worker_id: str, tokens: int, running: int, start_ns: int, end_ns: int
    ) -> None:
        """D computed ``tokens`` prompt tokens of a LOCAL request beside ``running`` requests
        between the two instants: the time past the compute, per running request, is a join."""
        if not start_ns or end_ns <= start_ns:
            return
        over = (end_ns - start_ns) / 1e6 - self.compute_ms(worker_id, tokens)
        sample = max(0.0, over) / running
        self._worker(worker_id).join_ms.update(sample)
        self.fleet.join_ms.update(sample)

    def _stepped(self, worker_id: str, start_ns: int, end_ns: int) -> None:
        """D's first step after the KV landed took ``start_ns -> end_ns``."""
        if start_ns and end_ns > start_ns:
            ms = (end_ns - start_ns) / 1e6
            self._worker(worker_id).step_ms.update(ms)
            self.fleet.step_ms.update(ms)

    def learn(
        self,
        mode: TransferMode,
        prefill_id: str | None,
        decode_id: str,
        prompt_tokens: int,
        *,
        prefill_hit: int = 0,
        decode_hit: int = 0,
        cached_tokens: int | None = None,
        timing: Timing | None,
        published_ns: int = 0,
        queued: int = 0,
        running: int = 0,
    ) -> None:
        """A request finished: learn from its ``timing`` (the last TokenChunk's). ``cached_tokens``
        is that chunk's ``num_cached_tokens``; the hits are what the index said at routing, and
        ``queued`` D's requests waiting for a prefill then (LOCAL: a wait that teaches no rate),
        ``running`` those past their first token (LOCAL: what the join time is learned from)."""
        if timing is None:
            return
        t = timing
        if mode is TransferMode.LOCAL or prefill_id is None:
            computed = prompt_tokens - (cached_tokens or 0)
            if not queued and running:  # beside D's decoding requests: their join time
                self._joined(decode_id, computed, running, t.decode_received, t.first_token)
            elif not queued:
                self._prefilled(decode_id, computed, t.decode_received, t.first_token)
            if published_ns and t.decode_received:  # clocks of two hosts: at least 0
                self.local_overhead_ms.update(max(0, t.decode_received - published_ns) / 1e6)
            return
        self._prefilled(prefill_id, prompt_tokens - prefill_hit, t.prefill_start, t.prefill_end)
        self._stepped(decode_id, t.kv_landed, t.first_token)
        hops = ((published_ns, t.prefill_received), (t.kv_sent, t.kv_landed))
        if all(a and b for a, b in hops):  # a hop between two hosts' clocks: at least 0
            self.handoff_ms.update(sum(max(0, b - a) for a, b in hops) / 1e6)
        moved = prompt_tokens - decode_hit
        if mode is TransferMode.PULL and moved > 0 and t.prefill_end and t.kv_sent > t.prefill_end:
            seconds = (t.kv_sent - t.prefill_end) / 1e9
            self.bytes_per_s.update(moved * self.bytes_per_token.value / seconds)

    def observe_push(self, pushed: KvPushed) -> None:
        """A push finished (``KvPushed``): transfer rate, bytes per token, the tail's share."""
        if pushed.bytes <= 0 or pushed.push_ms <= 0:
            return
        self.bytes_per_s.update(pushed.bytes * 1000.0 / pushed.push_ms)
        if pushed.num_tokens > 0:
            self.bytes_per_token.update(pushed.bytes / pushed.num_tokens)
        t = pushed.timing
        if t is not None and t.prefill_end and t.kv_sent >= t.prefill_end:
            tail_ms = (t.kv_sent - t.prefill_end) / 1e6
            self.push_tail_share.update(min(1.0, tail_ms / pushed.push_ms))

    async def on_kv_event(self, subject: str, message: object) -> None:
        """Bus handler for ``kvpush.v1.kv.*.*``: learns from every ``KvPushed``."""
        if isinstance(message, KvPushed):
            self.observe_push(message)
