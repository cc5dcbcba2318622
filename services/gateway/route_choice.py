"""The routed policy's choice: the cheapest candidate by ``CostModel``, and why.

``choose`` scores every candidate the router allows for one prompt: LOCAL on each live D and,
for the disaggregated mode allowed (the deployment's push or pull, or the client's override),
every (P, D) pair. A transfer's estimate is a D share's total for a P part
(``CostModel.prefill_parts`` and ``transfer_shares``), which grows with the P part, so the
cheapest pair is the cheapest P with the D cheapest for it: O(P + D) parts, then the pairs of
the ``ALTERNATIVES`` + 1 cheapest of each side, and full estimates (with their terms) only for
the choice and its runners-up. A D on the cheapest P's GPU (heartbeats' ``gpu``) takes turns
with it (``TransferShare.in_turns``, never below ``total``): its cheapest pair is that P in
turns or the cheapest P on another GPU, whichever is less (still exact, still O(P + D)).
Equal costs go to the least-loaded worker, as the least-loaded policy orders them
(``decode_order``, ``prefill_order``), and a LOCAL/transfer tie to LOCAL (less work). Each
worker's heartbeat, load and ``CostModel.view`` are read once per decision, whatever the modes.

``RouteExplanation`` is what the trace and metrics show: the reason the candidates were what
they were (``RouteReason``), the chosen estimate, the runners-up, the prefix tokens matched on
the chosen P and D, and the decision's own cost; ``RouteNote`` is what the dashboard's row of
the request shows of it (``record_decision`` records both ways, ``route_note`` makes the note).

Threading model: pure functions of their arguments, on the gateway's loop.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from kvpush.schemas.messages import TransferMode, WorkerHeartbeat
from kvpush.services.gateway.cost_model import Candidate, CostModel, Estimate, TransferShare

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from prometheus_client import Counter, Histogram

ALTERNATIVES: Final = 3
"""Runners-up kept in a route's explanation."""


class RouteReason(str, enum.Enum):
    """Why a route's candidates were the ones scored (the metric's ``reason`` label)."""

    OVERRIDE = "override"  # the request's kvpush_mode (or prompt_logprobs, a migration) chose
    COLD = "cold"  # the cost model lacks measurements: the fixed --local-threshold rule chose
    COST = "cost"  # LOCAL and the deployment's mode compared by estimated TTFT
    ONLY_LOCAL = "only-local"  # no prefill worker alive: D computes the prompt
    LEAST_LOADED = "least-loaded"  # the least-loaded policy (--routing least-loaded)


class LiveWorker(Protocol):
    """What the choice reads of a live worker (``worker_registry.WorkerState``)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def gpu(self) -> str: ...  # the GPU its engine runs on ("": none known)
    @property
    def heartbeat(self) -> WorkerHeartbeat: ...
    @property
    def load(self) -> int: ...
    def load_running(self) -> tuple[int, int]: ...
    @property
    def last_pick(self) -> float: ...


class DecisionMetrics(Protocol):
    """The gateway's metrics of its decisions (``metrics.GatewayMetrics``)."""

    route_decisions: Counter
    route_decision_seconds: Histogram


W = TypeVar("W", bound=LiveWorker)
_DecodeKey = tuple[int, int, float]  # decode_order's
_PrefillKey = tuple[int, float]  # prefill_order's


def decode_order(state: LiveWorker) -> tuple[int, int, float]:
    """Least-loaded order of decode workers: load, then more free blocks, then least recent."""
    return (state.load, -state.heartbeat.free_blocks, state.last_pick)


def prefill_order(state: LiveWorker) -> tuple[int, float]:
    """Least-loaded order of prefill workers: load, then least recently picked."""
    return (state.load, state.last_pick)


@dataclass(frozen=True)
class RouteExplanation:
    """Why a routed request went where it went."""

    reason: RouteReason
    choice: Estimate
    alternatives: tuple[Estimate, ...]
    decision_us: float  # the router's own time for this decision

    @property
    def prefill_prefix_tokens(self) -> int:
        return self.choice.candidate.prefill_hit

    @property
    def decode_prefix_tokens(self) -> int:
        return self.choice.candidate.decode_hit

    def span_attributes(self) -> dict[str, str | float | list[int]]:
        """The decision as attributes of the request's span."""
        return {
            "kvpush.route.choice": self.choice.candidate.label,
            "kvpush.route.reason": self.reason.value,
            "kvpush.route.estimate_ms": round(self.choice.total_ms, 3),
            "kvpush.route.candidates": self.candidates_text(),
            "kvpush.route.prefix_tokens": [self.prefill_prefix_tokens, self.decode_prefix_tokens],
        }

    def candidates_text(self) -> str:
        """The choice and the runners-up, cheapest first: ``push p0>d1 12.3ms; local d1 ...``."""
        return "; ".join(str(e) for e in (self.choice, *self.alternatives))


@dataclass(frozen=True)
class Choice(Generic[W]):
    decode: W
    prefill: W | None  # None: LOCAL
    choice: Estimate
    alternatives: tuple[Estimate, ...]
    carrier: W | None = None  # LOCAL: the least-loaded P (prefill_order), when P were read


def choose(
    model: CostModel,
    prompt_tokens: int,
    hits: Mapping[str, int],
    decodes: Sequence[W],
    prefills: Sequence[W],
    modes: Sequence[TransferMode],
) -> Choice[W]:
    """The cheapest candidate of ``modes`` over the given live workers (``decodes`` non-empty;
    ``prefills`` non-empty when a mode other than LOCAL is allowed)."""
    # each worker's heartbeat, load and view are read once, for every mode; its key is its
    # place in the least-loaded order (as decode_order and prefill_order make it)
    d_ids: list[str] = []
    d_loads: list[int] = []
    d_running: list[int] = []
    d_keys: list[_DecodeKey] = []
    for d in decodes:
        load, running = d.load_running()
        d_ids.append(d.worker_id)
        d_loads.append(load)
        d_running.append(running)
        d_keys.append((load, -d.heartbeat.free_blocks, d.last_pick))
    d_hits, d_missing = _prefix_hits(hits, d_ids, prompt_tokens)
    d_views = model.views(d_ids)
    p_ids: list[str] = []
    p_loads: list[int] = []
    p_hits: list[int] = []
    p_keys: list[_PrefillKey] = []
    p_gpus: list[str] = []  # each P's GPU ("": CPU): a D on one takes turns with it
    p_parts: list[float] = []
    p_ranked: list[tuple[float, _PrefillKey, int]] = []
    # (estimate, mode rank, D key, P key, P index, D index): the cheapest is the smallest;
    # LOCAL's P key is () and its P index -1
    ranked: list[tuple[float, int, _DecodeKey, _PrefillKey | tuple[()], int, int]] = []
    for mode in modes:
        if mode is TransferMode.LOCAL:
            # every D (the final sort keeps the cheapest; one sort fewer than ranking them here)
            parts = model.local_parts(d_views, d_loads, d_missing, d_running)
            d_all = zip(parts, d_keys, range(len(d_ids)), strict=True)
            ranked += [(cost, 0, key, (), -1, i) for cost, key, i in d_all]
            continue
        if not p_ranked:
            for p in prefills:
                load = p.load
                p_gpus.append(p.gpu)
                p_ids.append(p.worker_id)
                p_loads.append(load)
                p_keys.append((load, p.last_pick))
            p_hits, p_missing = _prefix_hits(hits, p_ids, prompt_tokens)
            p_views = model.views(p_ids)
            p_parts = model.prefill_parts(p_views, p_loads, p_missing)
            p_ranked = sorted(zip(p_parts, p_keys, range(len(p_ids)), strict=True))[
                : ALTERNATIVES + 1
            ]
        shares = model.transfer_shares(mode, d_views, d_loads, d_missing, d_running)
        (cheapest_p, cheapest_key, cheapest_j), *other_ps = p_ranked
        totals = TransferShare.totals(shares, cheapest_p)
        partner: dict[int, tuple[_PrefillKey, int]] = {}  # D -> its cheapest P, if not that one
        if gpu := p_gpus[cheapest_j]:
            # a D on that P's GPU takes turns with it: its cheapest pair is that P in turns or
            # the cheapest P elsewhere (each grows with P's part: exact, and still O(P + D))
            away = min(
                (
                    (cost, key, j)
                    for cost, key, j in zip(p_parts, p_keys, range(len(p_ids)), strict=True)
                    if p_gpus[j] != gpu
                ),
                default=None,
            )
            for i, d in enumerate(decodes):
                if d.gpu == gpu:
                    totals[i] = shares[i].in_turns(cheapest_p)
                    if away is not None and (apart := shares[i].total(away[0])) < totals[i]:
                        totals[i], partner[i] = apart, (away[1], away[2])
        d_ranked = sorted(zip(totals, d_keys, range(len(d_ids)), strict=True))[: ALTERNATIVES + 1]
        rank = 1 if mode is TransferMode.PUSH else 2
        # each D's cheapest pair has its total already; the other P's pairs are computed
        ranked += [
            (cost, rank, d_key, *partner.get(i, (cheapest_key, cheapest_j)), i)
            if partner
            else (cost, rank, d_key, cheapest_key, cheapest_j, i)
            for cost, d_key, i in d_ranked
        ]
        ranked += [
            (
                shares[i].in_turns(p_cost)
                if p_gpus[j] and p_gpus[j] == decodes[i].gpu
                else shares[i].total(p_cost),
                rank,
                d_key,
                p_key,
                j,
                i,
            )
            for p_cost, p_key, j in other_ps
            for _, d_key, i in d_ranked
            if not partner or j != partner.get(i, (None, cheapest_j))[1]  # that pair: in already
        ]
    ranked.sort()
    estimates: list[Estimate] = []
    for cost, rank, _, _, j, i in ranked[: ALTERNATIVES + 1]:
        if j < 0:
            candidate = Candidate(
                TransferMode.LOCAL,
                d_ids[i],
                d_loads[i],
                d_hits[i],
                prompt_tokens,
                decode_running=d_running[i],
            )
        else:
            mode = TransferMode.PUSH if rank == 1 else TransferMode.PULL
            candidate = Candidate(
                mode,
                d_ids[i],
                d_loads[i],
                d_hits[i],
                prompt_tokens,
                p_ids[j],
                p_loads[j],
                p_hits[j],
                decode_running=d_running[i],
                shared_gpu=bool(p_gpus[j]) and p_gpus[j] == decodes[i].gpu,
            )
        # the choice with its terms; the runners-up with their totals only
        estimates.append(model.estimate(candidate) if not estimates else Estimate(candidate, cost))
    _, _, _, _, best_p, best_d = ranked[0]
    prefill = prefills[best_p] if best_p >= 0 else None
    carrier = None
    if prefill is None and p_keys:  # the first least-loaded, as min(prefills, key=prefill_order)
        carrier = prefills[p_keys.index(min(p_keys))]
    return Choice(decodes[best_d], prefill, estimates[0], tuple(estimates[1:]), carrier)


def _prefix_hits(
    hits: Mapping[str, int], worker_ids: Sequence[str], prompt_tokens: int
) -> tuple[list[int], list[int]]:
    """Each worker's prefix hit on the prompt (0 where ``hits`` has none; never the prompt's
    last token: vLLM computes it whatever its cache holds) and the prompt tokens it lacks."""
    whole = max(prompt_tokens, 0)
    if not hits:
        return [0] * len(worker_ids), [whole] * len(worker_ids)
    most = prompt_tokens - 1
    found = [max(0, min(hits[w], most)) if w in hits else 0 for w in worker_ids]
    return found, [whole - hit for hit in found]


@dataclass(frozen=True)
class RouteNote:
    """A request's routing decision as the dashboard's row shows it (``RecentRequests``)."""

    reason: str  # a RouteReason's value
    decode_id: str
    prefill_id: str = ""  # "": D computed the prompt (LOCAL)
    choice: str = ""  # the chosen candidate's label ("push p0>d1"); "": not the routed policy
    estimate_ms: float | None = None  # its estimated TTFT
    prefix_tokens: tuple[int, int] | None = None  # matched on the chosen P and D

    def row(self) -> dict[str, Any]:
        return {
            "route_reason": self.reason,
            "route_choice": self.choice,
            "estimate_ms": self.estimate_ms,
            "prefix_tokens": list(self.prefix_tokens) if self.prefix_tokens else None,
            "decode_id": self.decode_id,
            "prefill_id": self.prefill_id,
        }


def record_decision(
    mode: TransferMode,
    explained: RouteExplanation | None,
    requested: TransferMode | None,
    span: Span,
    metrics: DecisionMetrics,
) -> str:
    """A routing decision (its mode and, under the routed policy, its explanation) in the
    request's span and the gateway's metrics (``kvpush_gateway_route_decisions_total``,
    ``kvpush_gateway_route_decision_seconds``); its reason (a ``RouteReason``'s value)."""
    reason = RouteReason.OVERRIDE if requested is not None else RouteReason.LEAST_LOADED
    if explained is not None:  # --routing routed
        reason = explained.reason
        metrics.route_decision_seconds.observe(explained.decision_us / 1e6)
        span.set_attributes(explained.span_attributes())
    metrics.route_decisions.labels(mode.value, reason.value).inc()
    return reason.value


def route_note(
    reason: str, decode_id: str, prefill_id: str, explained: RouteExplanation | None
) -> RouteNote:
    """The dashboard's note of a decision (``prefill_id`` "": LOCAL)."""
    if explained is None:
        return RouteNote(reason, decode_id, prefill_id)
    return RouteNote(
        reason,
        decode_id,
        prefill_id,
        choice=explained.choice.candidate.label,
        estimate_ms=round(explained.choice.total_ms, 3),
        prefix_tokens=(explained.prefill_prefix_tokens, explained.decode_prefix_tokens),
    )
