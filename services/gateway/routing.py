"""Worker registry (the gateway's view of ``services.membership``) and the routing policy: which
P, which D, which mode.

``WorkerRegistry`` feeds the heartbeats seen on ``kvpush.v1.heartbeat.>`` to a ``Membership``
(docs/bus.md, membership): a worker is *alive* while its heartbeats keep arriving within its
lease (the one its heartbeats state, 1.5 s by default; ``--worker-lease-s`` for heartbeats that
state none); a look-up expires the members past their lease first. A *draining* worker stays
alive (its in-flight requests finish) but gets no new work and does not count for readiness. A
heartbeat with a new epoch means the worker restarted: requests routed to an older epoch are
lost there (``Gateway`` moves them to another decode worker, or fails them at once).

A worker's load is the heartbeat's ``in_flight`` (its ``queue_depth`` is part of it) plus the
requests this gateway sent to it since that heartbeat (so a burst between two heartbeats spreads
instead of piling onto one worker), less those of this gateway's requests the heartbeat still
counts that ended since (``Router.ended``: a beat read between two requests does not count the
finished one for up to a heartbeat period).

``Router.route`` has two policies (``RoutingPolicy``, ``--routing``):

- **least-loaded**: the mode first: a per-request ``kvpush_mode`` wins; otherwise prompts
  shorter than ``local_threshold`` tokens go LOCAL (only D works), the rest use the
  deployment's mode (push or pull). Then the least-loaded worker per role; decode ties prefer
  more free blocks; remaining ties go to the least recently picked worker.
- **routed** (the default): the cheapest candidate by estimated TTFT (``route_choice``,
  ``cost_model``), given each worker's prefix-cache hit on the prompt (``PrefixLookup``, when
  the gateway has an index) and its load. Candidates: the override's mode alone when the request
  sets one; LOCAL alone with no live P; while the cost model is cold, the least-loaded policy's
  mode (``--local-threshold`` is the cold-start rule); else LOCAL on every D (unless
  ``local_threshold`` is 0: never LOCAL unasked, in both policies) and the deployment's mode on
  every (P, D) pair. Ties go to the least-loaded worker. The route carries
  a ``RouteExplanation`` (trace attributes, metrics). ``learn`` feeds finished requests back.

LOCAL still publishes on ``req.<P>.<D>`` with a live P (which ignores it) or, with no prefill
worker alive, on ``req.<DECODE_ONLY>.<D>``. Push and pull need a live P.

``first_token_by`` says who samples the answer's first token: the deployment's choice
(``--first-token``, prefill by default) for push and pull when the chosen P sends one (its
heartbeat's ``sends_first_token``) and P's token gives the answer one engine gives
(``samples_on_prefill``), else decode.

``wait_for(role)`` returns once a worker of ``role`` has been seen since the registry started
(the gateway holds requests on it while workers start).

Bounds: at most ``max_workers`` members; heartbeats of further workers are dropped and counted.
Threading model: asyncio, on the gateway's loop only (the bus handler and request handlers);
no locks, no awaits inside a selection.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvpush.connector import samples_on_prefill
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    SamplingSpec,
    Timing,
    TransferMode,
    WorkerHeartbeat,
    WorkerRole,
)
from kvpush.services.gateway.cost_model import CostModel
from kvpush.services.gateway.route_choice import (
    RouteExplanation,
    RouteNote,
    RouteReason,
    choose,
    decode_order,
    prefill_order,
    route_note,
)
from kvpush.services.membership import DEFAULT_LEASE_S, LeaveReason, Member, Membership

log = logging.getLogger(__name__)

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


@dataclass
class WorkerState:
    """A live member and what this gateway's selection keeps of it."""

    member: Member
    sent_since_heartbeat: int = 0
    last_pick: float = 0.0
    ended_since_heartbeat: int = 0  # this gateway's requests that heartbeat counts, ended since
    beats: int = 0  # heartbeats of this member read (a Route keeps the count it was sent under)

    @property
    def heartbeat(self) -> WorkerHeartbeat:
        return self.member.heartbeat

    @property
    def load(self) -> int:
        hb = self.heartbeat  # in_flight holds queue_depth: a queued request counts once
        return max(0, hb.in_flight - self.ended_since_heartbeat) + self.sent_since_heartbeat

    @property
    def running(self) -> int:
        """Requests past their first token (on D: decoding, or waiting for their KV); inside
        ``load`` too. An ended request was past its first token."""
        hb = self.heartbeat
        return max(0, hb.in_flight - hb.queue_depth - self.ended_since_heartbeat)


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


class NoWorkerError(LookupError):
    """No live, non-draining worker of ``role``."""

    def __init__(self, role: WorkerRole) -> None:
        super().__init__(f"no {role.value} worker is available")
        self.role = role


@dataclass
class RegistryStats:
    expired: int = 0
    restarts: int = 0
    model_mismatch: set[str] = field(default_factory=set)


class WorkerRegistry:
    """Live workers by role; see the module docstring."""

    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        model: str | None = None,
        max_workers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.membership = Membership(lease_s, max_members=max_workers, clock=clock)
        self.membership.listeners.joined.append(self._joined)
        self.membership.listeners.left.append(self._left)
        self.model = model
        self.stats = RegistryStats()
        self._clock = clock
        self._workers: dict[tuple[WorkerRole, str], WorkerState] = {}
        self._seen = {role: asyncio.Event() for role in WorkerRole}  # set: a worker was seen

    async def on_message(self, subject: str, message: BusMessage) -> None:
        """Bus handler for ``kvpush.v1.heartbeat.>``."""
        if isinstance(message, WorkerHeartbeat):
            self.observe(message)

    def observe(self, hb: WorkerHeartbeat) -> None:
        member = self.membership.observe(hb)
        state = self._workers.get((hb.role, hb.worker_id))
        if member is not None and state is not None and state.member is member:
            state.sent_since_heartbeat = state.ended_since_heartbeat = 0
            state.beats += 1

    def _joined(self, member: Member) -> None:
        hb = member.heartbeat
        self._workers[member.key] = WorkerState(member)
        self._seen[hb.role].set()
        if self.model and hb.model != self.model and hb.worker_id not in self.stats.model_mismatch:
            self.stats.model_mismatch.add(hb.worker_id)
            log.warning("worker %s serves %r, gateway %r", hb.worker_id, hb.model, self.model)

    def _left(self, member: Member) -> None:
        state = self._workers.get(member.key)
        if state is not None and state.member is member:
            del self._workers[member.key]
        if member.left_because is LeaveReason.RESTARTED:
            self.stats.restarts += 1
        elif member.left_because is LeaveReason.EXPIRED:
            self.stats.expired += 1

    @property
    def rejected(self) -> int:
        """Heartbeats of workers past ``max_workers``, dropped."""
        return self.membership.rejected

    def seen(self, role: WorkerRole) -> bool:
        """Whether a worker of ``role`` has sent a heartbeat since the registry started."""
        return self._seen[role].is_set()

    async def wait_for(self, role: WorkerRole) -> None:
        """Return once a worker of ``role`` has been seen (at once if one has been)."""
        await self._seen[role].wait()

    async def back(self, role: WorkerRole, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait up to ``timeout_s`` for a live worker of ``role`` when one was seen before (a
        worker that missed its lease on a busy host rejoins within a few); False at once when
        none ever was."""
        deadline = time.monotonic() + timeout_s
        while self._seen[role].is_set() and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            if self.alive(role):
                return True
        return False

    def alive(
        self, role: WorkerRole, *, include_draining: bool = False, tick: bool = True
    ) -> list[WorkerState]:
        """The live workers of ``role`` (``tick``: expire those past their lease first)."""
        if tick:
            self.membership.tick()
        members = self.membership.members(role, include_draining=include_draining)
        return [self._workers[m.key] for m in members]

    def epoch(self, role: WorkerRole, worker_id: str) -> int | None:
        """The live worker's epoch, or None if it is gone (lease expired)."""
        self.membership.tick()
        return self.membership.epoch(role, worker_id)

    def pick(self, role: WorkerRole, *, count: bool = True) -> WorkerState:
        candidates = self.alive(role)
        if not candidates:
            raise NoWorkerError(role)
        if role is WorkerRole.DECODE:
            best = min(candidates, key=decode_order)
        else:
            best = min(candidates, key=prefill_order)
        self.mark(best, count=count)
        return best

    def mark(self, state: WorkerState, *, count: bool = True) -> None:
        """``state`` was picked now (and, with ``count``, sent a request)."""
        state.last_pick = self._clock()
        if count:
            state.sent_since_heartbeat += 1

    def ended(self, role: WorkerRole, worker_id: str, epoch: int, beats: int) -> None:
        """A request sent to ``worker_id`` (of ``epoch``, after ``beats`` of its heartbeats)
        ended: it leaves the worker's load now. No heartbeat read since it was sent: it is in
        ``sent_since_heartbeat``; else the latest one counts it (until the next resets both)."""
        state = self._workers.get((role, worker_id))
        if state is None or state.heartbeat.epoch != epoch or beats < 0:
            return
        if state.beats == beats:
            state.sent_since_heartbeat = max(0, state.sent_since_heartbeat - 1)
        else:
            state.ended_since_heartbeat += 1

    def counts(self) -> dict[str, int]:
        return {role.value: len(self.alive(role)) for role in WorkerRole}


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
        decode = self.registry.pick(WorkerRole.DECODE)
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
        if requested is not None:
            if requested is not TransferMode.LOCAL and not prefills:
                raise NoWorkerError(WorkerRole.PREFILL)
            modes, reason = (requested,), RouteReason.OVERRIDE
        elif not prefills:
            modes, reason = (TransferMode.LOCAL,), RouteReason.ONLY_LOCAL
        elif not self.costs.warm:
            short = prompt_tokens < self.local_threshold
            modes = (TransferMode.LOCAL if short else self.default_mode,)
            reason = RouteReason.COLD
        elif self.local_threshold == 0:  # never LOCAL unless asked: pick the pair by cost
            modes, reason = (self.default_mode,), RouteReason.COST
        else:
            modes, reason = (TransferMode.LOCAL, self.default_mode), RouteReason.COST
        decodes = self.registry.alive(WorkerRole.DECODE, tick=False)  # ticked just now
        if not decodes:
            raise NoWorkerError(WorkerRole.DECODE)
        transfer = modes != (TransferMode.LOCAL,)
        hits: dict[str, int] = {}
        if self.prefix is not None and self.prefix.block_size > 0 and not isinstance(prompt, int):
            workers = [s.heartbeat.worker_id for s in decodes]
            if transfer:
                workers += [s.heartbeat.worker_id for s in prefills]
            hits = self.prefix.matched_tokens(prompt, workers)
        picked = choose(self.costs, prompt_tokens, hits, decodes, prefills, modes)
        decode, prefill = picked.decode, picked.prefill
        self.registry.mark(decode)
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
        )

    def ended(self, route: Route) -> None:
        """A request of ``route`` ended (answered, failed or abandoned): D's load drops now.
        (P's request ended earlier, at an instant the gateway does not see: its beat decides.)"""
        decode = WorkerRole.DECODE
        self.registry.ended(decode, route.decode_id, route.decode_epoch, route.decode_beats)

    def lost(self, route: Route) -> WorkerRole | None:
        """The role whose worker of ``route`` died or restarted (decode first: its work is
        lost), or None while both serve."""
        if self.registry.epoch(WorkerRole.DECODE, route.decode_id) != route.decode_epoch:
            return WorkerRole.DECODE
        if route.prefill_epoch is None:
            return None
        prefill_epoch = self.registry.epoch(WorkerRole.PREFILL, route.prefill_id)
        return WorkerRole.PREFILL if prefill_epoch != route.prefill_epoch else None


def first_token_by(choice: WorkerRole, route: Route, sampling: SamplingSpec) -> WorkerRole:
    """Who samples a request's first token: ``choice`` (the deployment's) where P can (a
    prefill worker of an older kvpush never sends one: D would wait for it in vain)."""
    if not route.prefill_sends_first_token or not samples_on_prefill(sampling):
        return WorkerRole.DECODE
    return choice
