"""The routing policy: which P, which D, which mode (``Router``), over the live workers of
``worker_registry.WorkerRegistry`` (their load, their epochs).

``Router.route`` has two policies (``RoutingPolicy``, ``--routing``):

- **least-loaded**: the mode first: a per-request ``kvpush_mode`` wins; otherwise prompts
  shorter than ``local_threshold`` tokens go LOCAL (only D works), the rest use the
  deployment's mode (push or pull). Then the least-loaded worker per role; decode ties prefer
  more free blocks; remaining ties go to the least recently picked worker.
- **routed** (the default): the cheapest candidate by estimated TTFT (``route_choice``,
  ``cost_model``), given each worker's prefix-cache hit on the prompt (``PrefixLookup``, when
  the gateway has an index) and its load. Candidates: the override's mode alone when the request
  sets one; LOCAL alone with no live P; while the cost model is cold, the least-loaded policy's
  mode (``--local-threshold`` is the cold-start rule), but LOCAL while a D is idle (it waits for
  nothing: a hand-off only adds, as the warm model would say) or while every P runs on a D's
  GPU (``on_decode_gpus``: its prefill takes turns with D's, so a push saves nothing there and
  adds the hand-off; one cold push made the P99 of a one-GPU run); else LOCAL on every D (unless
  ``local_threshold`` is 0: never LOCAL unasked, in both policies) and the deployment's mode on
  every (P, D) pair. Ties go to the least-loaded worker. The route carries
  a ``RouteExplanation`` (trace attributes, metrics). ``learn`` feeds finished requests back.

LOCAL still publishes on ``req.<P>.<D>`` with a live P (which ignores it) or, with no prefill
worker alive, on ``req.<DECODE_ONLY>.<D>``. Push and pull need a live P.

``first_token_by`` says who samples the answer's first token: the deployment's choice
(``--first-token``, prefill by default) for push and pull when the chosen P sends one (its
heartbeat's ``sends_first_token``) and P's token gives the answer one engine gives
(``samples_on_prefill``), else decode.

Threading model: asyncio, on the gateway's loop only (the bus handler and request handlers);
no locks, no awaits inside a selection.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvpush.connector import samples_on_prefill
from kvpush.schemas.messages import (
    SamplingSpec,
    Timing,
    TransferMode,
    WorkerRole,
)
from kvpush.services.gateway.cost_model import CostModel
from kvpush.services.gateway.route_choice import (
    RouteExplanation,
    RouteNote,
    RouteReason,
    choose,
    prefill_order,
    route_note,
)
from kvpush.services.gateway.worker_registry import NoWorkerError, WorkerRegistry, WorkerState

DECODE_ONLY: Final = "_"
"""Prefill id of a LOCAL request published while no prefill worker is alive."""


class RoutingPolicy(str, enum.Enum):
    """How ``Router.route`` chooses (``--routing``); see the module docstring."""

    ROUTED = "routed"
    LEAST_LOADED = "least-loaded"


class PrefixLookup(Protocol):
    """What the router asks of the gateway's prefix index (``prefix_index.PrefixIndex``)."""

    block_size: int  # tokens per block the index hashes with (0 while unknown)

    def matched_tokens(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Leading prompt tokens (whole blocks only) each listed worker holds in its prefix
        cache, by worker id; a worker with none may be left out."""
        ...


@dataclass(frozen=True)
class Route:
    prefill_id: str
    decode_id: str
    mode: TransferMode
    decode_epoch: int
    prefill_epoch: int | None = None  # None: no real prefill worker takes part
    prefill_sends_first_token: bool = False  # its heartbeat says it sends FirstToken
    explanation: RouteExplanation | None = None  # the routed policy's: why this route
    decode_beats: int = -1  # D's heartbeats read when it was sent (-1: unknown; Router.ended)

    def note(self, reason: str) -> RouteNote:
        """The dashboard's note of this route (``reason``: ``record_decision``'s)."""
        prefill_id = self.prefill_id if self.prefill_epoch is not None else ""
        return route_note(reason, self.decode_id, prefill_id, self.explanation)


class Router:
    """Mode choice and P/D selection; see the module docstring."""

    def __init__(
        self,
        registry: WorkerRegistry,
        default_mode: TransferMode,
        local_threshold: int,
        *,
        prefix: PrefixLookup | None = None,
        routing: RoutingPolicy | str = RoutingPolicy.ROUTED,
        costs: CostModel | None = None,
    ) -> None:
        if default_mode is TransferMode.LOCAL:
            raise ValueError("the deployment mode is push or pull; LOCAL is chosen per request")
        self.registry = registry
        self.default_mode = default_mode
        self.local_threshold = local_threshold
        self.prefix = prefix
        self.policy = RoutingPolicy(routing)
        self.costs = costs if costs is not None else CostModel()

    def route(self, prompt: int | Sequence[int], requested: TransferMode | None = None) -> Route:
        """Choose mode, D and P for a prompt (its token ids, or only its length: no prefix
        look-up); raise ``NoWorkerError`` when a needed role has no worker."""
        if self.policy is RoutingPolicy.ROUTED:
            return self._routed(prompt, requested)
        return self._least_loaded(prompt if isinstance(prompt, int) else len(prompt), requested)

    def _least_loaded(self, prompt_tokens: int, requested: TransferMode | None) -> Route:
        mode = requested
        if mode is None:
            short = prompt_tokens < self.local_threshold
            mode = TransferMode.LOCAL if short else self.default_mode
        if mode is not TransferMode.LOCAL and not self.registry.alive(WorkerRole.PREFILL):
            if requested is not None:  # the client asked for a transfer: say why it can't be
                raise NoWorkerError(WorkerRole.PREFILL)
            mode = TransferMode.LOCAL  # degraded, not down: decode computes the prompt
        decode = self.registry.pick(WorkerRole.DECODE, running=mode is not TransferMode.LOCAL)
        if mode is TransferMode.LOCAL:
            try:  # any live P carries the subject; it ignores LOCAL requests, so no load
                prefill = self.registry.pick(WorkerRole.PREFILL, count=False)
            except NoWorkerError:
                d = decode.heartbeat
                return Route(DECODE_ONLY, d.worker_id, mode, d.epoch, decode_beats=decode.beats)
        else:
            prefill = self.registry.pick(WorkerRole.PREFILL)
        transfer = mode is not TransferMode.LOCAL
        return Route(
            prefill.heartbeat.worker_id,
            decode.heartbeat.worker_id,
            mode,
            decode.heartbeat.epoch,
            prefill.heartbeat.epoch if transfer else None,
            transfer and prefill.heartbeat.sends_first_token,
            decode_beats=decode.beats,
        )

    def _routed(self, prompt: int | Sequence[int], requested: TransferMode | None) -> Route:
        started = time.perf_counter_ns()
        prompt_tokens = prompt if isinstance(prompt, int) else len(prompt)
        prefills = self.registry.alive(WorkerRole.PREFILL)
        if requested is not None and requested is not TransferMode.LOCAL and not prefills:
            raise NoWorkerError(WorkerRole.PREFILL)
        decodes = self.registry.alive(WorkerRole.DECODE, tick=False)  # ticked just now
        if not decodes:
            raise NoWorkerError(WorkerRole.DECODE)
        if requested is not None:
            modes, reason = (requested,), RouteReason.OVERRIDE
        elif not prefills:
            modes, reason = (TransferMode.LOCAL,), RouteReason.ONLY_LOCAL
        elif not self.costs.warm:  # the fixed rule; an idle D or a P on D's GPU: LOCAL
            short = prompt_tokens < self.local_threshold
            spare = any(d.load == 0 for d in decodes) or on_decode_gpus(prefills, decodes)
            local = short or (spare and self.local_threshold > 0)
            modes = (TransferMode.LOCAL if local else self.default_mode,)
            reason = RouteReason.COLD
        elif self.local_threshold == 0:  # never LOCAL unless asked: pick the pair by cost
            modes, reason = (self.default_mode,), RouteReason.COST
        else:
            modes, reason = (TransferMode.LOCAL, self.default_mode), RouteReason.COST
        transfer = modes != (TransferMode.LOCAL,)
        hits: dict[str, int] = {}
        if self.prefix is not None and self.prefix.block_size > 0 and not isinstance(prompt, int):
            workers = [s.worker_id for s in decodes]
            if transfer:
                workers += [s.worker_id for s in prefills]
            hits = self.prefix.matched_tokens(prompt, workers)
        picked = choose(self.costs, prompt_tokens, hits, decodes, prefills, modes)
        decode, prefill = picked.decode, picked.prefill
        self.registry.mark(decode, running=prefill is not None)  # a transfer: a step on D
        if prefill is not None:
            self.registry.mark(prefill)
        explanation = RouteExplanation(
            reason,
            picked.choice,
            picked.alternatives,
            (time.perf_counter_ns() - started) / 1000.0,
        )
        d = decode.heartbeat
        if prefill is None:
            prefill_id = DECODE_ONLY
            if prefills:  # any live P carries the subject; it ignores LOCAL requests
                carrier = picked.carrier  # the least-loaded, when the choice read them
                if carrier is None:
                    carrier = min(prefills, key=prefill_order)
                self.registry.mark(carrier, count=False)
                prefill_id = carrier.heartbeat.worker_id
            local = TransferMode.LOCAL
            return Route(
                prefill_id, d.worker_id, local, d.epoch, None, False, explanation, decode.beats
            )
        p = prefill.heartbeat
        mode = picked.choice.candidate.mode
        return Route(
            p.worker_id,
            d.worker_id,
            mode,
            d.epoch,
            p.epoch,
            p.sends_first_token,
            explanation,
            decode.beats,
        )

    def learn(
        self,
        route: Route,
        prompt_tokens: int,
        cached_tokens: int | None,
        timing: Timing | None,
        published_ns: int = 0,
    ) -> None:
        """A request of ``route`` finished: feed its timing to the cost model (``timing``: the
        last TokenChunk's, ``cached_tokens``: its ``num_cached_tokens``)."""
        explained = route.explanation
        chosen = explained.choice.candidate if explained else None
        self.costs.learn(
            route.mode,
            route.prefill_id if route.prefill_epoch is not None else None,
            route.decode_id,
            prompt_tokens,
            prefill_hit=explained.prefill_prefix_tokens if explained else 0,
            decode_hit=explained.decode_prefix_tokens if explained else 0,
            cached_tokens=cached_tokens,
            timing=timing,
            published_ns=published_ns,
            queued=max(0, chosen.decode_load - chosen.decode_running) if chosen else 0,
            running=chosen.decode_running if chosen else 0,
        )

    def started(self, route: Route) -> None:
        """The answer of ``route`` got its first token: a LOCAL request on D runs now (D's
        heartbeat says so up to a heartbeat period later)."""
        if route.mode is TransferMode.LOCAL:
            decode = WorkerRole.DECODE
            self.registry.started(decode, route.decode_id, route.decode_epoch, route.decode_beats)

    def ended(self, route: Route, *, started: bool) -> None:
        """A request of ``route`` ended (answered, failed or abandoned; ``started``: it had its
        first token): D's load drops now. (P's request ended earlier, at an instant the gateway
        does not see: its beat decides.)"""
        running = started or route.mode is not TransferMode.LOCAL
        self.registry.ended(
            WorkerRole.DECODE,
            route.decode_id,
            route.decode_epoch,
            route.decode_beats,
            running=running,
        )

    def lost(self, route: Route) -> WorkerRole | None:
        """The role whose worker of ``route`` died or restarted (decode first: its work is
        lost), or None while both serve."""
        if self.registry.epoch(WorkerRole.DECODE, route.decode_id) != route.decode_epoch:
            return WorkerRole.DECODE
        if route.prefill_epoch is None:
            return None
        prefill_epoch = self.registry.epoch(WorkerRole.PREFILL, route.prefill_id)
        return WorkerRole.PREFILL if prefill_epoch != route.prefill_epoch else None


def on_decode_gpus(prefills: Sequence[WorkerState], decodes: Sequence[WorkerState]) -> bool:
    """Does every live P run on a GPU that a live D runs on (no P names one: False)? Any D:
    while cold, a fleet of P and D pairs on shared GPUs computes every prompt on D, also
    where a P could push to a D on another GPU."""
    gpus = {d.gpu for d in decodes if d.gpu}
    return bool(prefills) and all(p.gpu in gpus for p in prefills)


def first_token_by(choice: WorkerRole, route: Route, sampling: SamplingSpec) -> WorkerRole:
    """Who samples a request's first token: ``choice`` (the deployment's) where P can (a
    prefill worker of an older kvpush never sends one: D would wait for it in vain)."""
    if not route.prefill_sends_first_token or not samples_on_prefill(sampling):
        return WorkerRole.DECODE
    return choice
