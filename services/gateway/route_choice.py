"""The routed policy's choice: the cheapest candidate by ``CostModel``, and why.

``choose`` scores every candidate the router allows for one prompt: LOCAL on each live D and,
for the disaggregated mode allowed (the deployment's push or pull, or the client's override),
every (P, D) pair. A transfer's estimate is a D share's total for a P part
(``CostModel.prefill_parts`` and ``decode_parts``), which grows with the P part, so the
cheapest pair is the cheapest P with the D cheapest for it: O(P + D) parts, then the pairs of
the ``ALTERNATIVES`` + 1 cheapest of each side, and full estimates (with their terms) only for
the choice and its runners-up. Each part holds its device's other queued compute
(``device_share``); a D on the cheapest P's device (heartbeats' ``gpu``) takes turns with it
(``TransferShare.in_turns``, never below ``total``: P's part holds D's queue): its cheapest
pair is that P in turns or the cheapest P elsewhere, whichever is less (exact, O(P + D)).
Equal costs go to the least-loaded worker (``decode_order``, ``prefill_order``), a
LOCAL/transfer tie to LOCAL (less work). Each worker's heartbeat, load, prefix hit and
``CostModel.view`` are read once per decision.

Only a candidate that can still be among the ``ALTERNATIVES`` + 1 cheapest is ranked: LOCAL on
the D no dearer than the cheapest few LOCAL, and of the other few P's pairs with a D those up to
the first whose total is dearer than the cheapest few ranked before them (a total only grows with
the P part). The choice and the runners-up are those of ranking every candidate named above, to
the bit (tests/unit/test_route_choice.py).

``RouteExplanation`` is what the trace and metrics show: the reason the candidates were what
they were (``RouteReason``), the chosen estimate, the runners-up, the prefix tokens matched on
the chosen P and D, and the decision's own cost; ``RouteNote`` is what the dashboard's row of
the request shows of it (``record_decision`` records both ways, ``route_note`` makes the note).

Threading model: pure functions of their arguments, on the gateway's loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from kvpush.schemas.messages import TransferMode, WorkerHeartbeat
from kvpush.services.gateway.cost_model import (
    Candidate,
    CostModel,
    DecodeRow,
    Estimate,
    PrefillRow,
    ShareTerms,
    TransferShare,
)
from kvpush.services.gateway.device_share import others

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
# (estimate, mode rank, D key, P key, P index, D index): the cheapest is the smallest; LOCAL's
# P key is () and its P index -1
_Ranked = tuple[float, int, _DecodeKey, _PrefillKey | tuple[()], int, int]


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
            "kvpush.route.terms": self.choice.terms_text,  # what the estimate adds up
            "kvpush.route.candidates": self.candidates_text(),
            "kvpush.route.prefix_tokens": [self.prefill_prefix_tokens, self.decode_prefix_tokens],
        }

    def candidates_text(self) -> str:
        """The choice and the runners-up, cheapest first: ``push p0>d1 12.3ms; local d1 ...``."""
        return "; ".join(str(e) for e in (self.choice, *self.alternatives))


@dataclass(slots=True)
class Choice(Generic[W]):
    """What ``choose`` found (made once per request and read once: not frozen, whose fields
    cost a call each to set)."""

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
    # the first of modes that is no LOCAL: its shares are made with LOCAL's
    transfer = next((mode for mode in modes if mode is not TransferMode.LOCAL), None)
    # each worker's heartbeat, load and prefix hit are read once, for every mode, in one pass a
    # role (the router asks this of every worker per request)
    whole, most = max(prompt_tokens, 0), prompt_tokens - 1
    get = hits.get if hits and most > 0 else None
    d_rows, d_keys, d_gpus = _read_decodes(decodes, get, whole, most)
    read = bool(prefills) and (transfer is not None or any(d_gpus))  # P's queues slow D's too
    p_rows, p_keys, p_gpus = _read_prefills(prefills, get, whole, most) if read else ([], [], [])
    sums = None  # each device's queued compute: its engines take turns on it
    if any(d_gpus) or any(p_gpus):
        sums = model.device_sums(p_rows, p_gpus, d_rows, d_gpus)
    local_parts, shares = model.decode_parts(transfer, d_rows, d_gpus, sums)
    p_parts = model.prefill_parts(p_rows, p_gpus, sums) if transfer is not None else []
    ranked: list[_Ranked] = []  # the cheapest is the smallest
    for mode in modes:
        if mode is TransferMode.LOCAL:
            # the D no dearer than the ALTERNATIVES + 1 cheapest (only those can be kept)
            cut = sorted(local_parts)[ALTERNATIVES] if len(local_parts) > ALTERNATIVES else math.inf
            ranked += [
                (cost, 0, key, (), -1, i)
                for cost, key, i in zip(local_parts, d_keys, range(len(d_keys)), strict=True)
                if cost <= cut
            ]
            continue
        if mode is not transfer:  # another transfer mode: its own shares
            shares = model.decode_parts(mode, d_rows, d_gpus, sums)[1]
        rank = 1 if mode is TransferMode.PUSH else 2
        _rank_pairs(ranked, rank, shares, d_gpus, d_keys, p_parts, p_keys, p_gpus)
    ranked.sort()
    estimates: list[Estimate] = []
    for cost, rank, _, _, j, i in ranked[: ALTERNATIVES + 1]:
        decode_id, load, running, missing = d_rows[i]
        d_device = 0.0  # the other engines' queued compute on D's device
        if sums and (d_gpu := d_gpus[i]):
            d_device = others(sums, d_gpu, model.wait_ms(decode_id, max(0, load - running)))
        if j < 0:
            candidate = Candidate(
                TransferMode.LOCAL,
                decode_id,
                load,
                whole - missing,
                prompt_tokens,
                decode_running=running,
                decode_device_ms=d_device,
            )
        else:
            prefill_id, prefill_load, prefill_missing = p_rows[j]
            gpu = p_gpus[j]
            candidate = Candidate(
                TransferMode.PUSH if rank == 1 else TransferMode.PULL,
                decode_id,
                load,
                whole - missing,
                prompt_tokens,
                prefill_id,
                prefill_load,
                whole - prefill_missing,
                decode_running=running,
                shared_gpu=bool(gpu) and gpu == d_gpus[i],
                prefill_device_ms=others(sums, gpu, model.wait_ms(prefill_id, prefill_load))
                if sums and gpu
                else 0.0,
                decode_device_ms=d_device,
            )
        # the choice with its terms; the runners-up with their totals only
        estimates.append(Estimate(candidate, cost) if estimates else model.estimate(candidate))
    _, _, _, _, best_p, best_d = ranked[0]
    prefill = prefills[best_p] if best_p >= 0 else None
    carrier = None
    if prefill is None and transfer is not None:  # the first least-loaded (prefill_order)
        carrier = prefills[p_keys.index(min(p_keys))]
    return Choice(decodes[best_d], prefill, estimates[0], tuple(estimates[1:]), carrier)


def _read_decodes(
    decodes: Sequence[LiveWorker], get: Callable[[str, int], int] | None, whole: int, most: int
) -> tuple[list[DecodeRow], list[_DecodeKey], list[str]]:
    """Each D's row for ``CostModel.decode_parts``, its ``decode_order`` key and its device
    (``device_share``; "": none). A prefix hit
    (``get``, None: no hits) is never the prompt's last token (vLLM computes it whatever its
    cache holds): max(0, min(hit, most)), without two calls per worker (``most`` > 0 with
    ``get``); the row holds the tokens missing of the ``whole`` prompt."""
    rows: list[DecodeRow] = []
    keys: list[_DecodeKey] = []
    gpus: list[str] = []
    for d in decodes:
        worker_id = d.worker_id
        load, running = d.load_running()
        hit = 0 if get is None or (hit := get(worker_id, 0)) <= 0 else most if hit > most else hit
        rows.append((worker_id, load, running, whole - hit))
        keys.append((load, -d.heartbeat.free_blocks, d.last_pick))
        gpus.append(d.gpu)
    return rows, keys, gpus


def _read_prefills(
    prefills: Sequence[LiveWorker], get: Callable[[str, int], int] | None, whole: int, most: int
) -> tuple[list[PrefillRow], list[_PrefillKey], list[str]]:
    """Each P's row for ``CostModel.prefill_parts`` (its hit as ``_read_decodes`` reads a D's),
    its ``prefill_order`` key and its GPU ("": CPU; a D on it takes turns with it)."""
    rows: list[PrefillRow] = []
    keys: list[_PrefillKey] = []
    gpus: list[str] = []
    for p in prefills:
        worker_id = p.worker_id
        load = p.load
        hit = 0 if get is None or (hit := get(worker_id, 0)) <= 0 else most if hit > most else hit
        rows.append((worker_id, load, whole - hit))
        keys.append((load, p.last_pick))
        gpus.append(p.gpu)
    return rows, keys, gpus


def _rank_pairs(
    ranked: list[_Ranked],
    rank: int,
    shares: list[ShareTerms],
    d_gpus: list[str],
    d_keys: list[_DecodeKey],
    p_parts: list[float],
    p_keys: list[_PrefillKey],
    p_gpus: list[str],
) -> None:
    """Add to ``ranked`` the (P, D) pairs of one transfer mode (``rank``: its place after LOCAL)
    that may be among the ``ALTERNATIVES`` + 1 cheapest: the cheapest pair of each of the
    cheapest few D, then the other few cheapest P with those D, only those no dearer than the
    cheapest few ranked by then (a dearer one cannot be kept, so it is not ranked)."""
    p_ranked = sorted(zip(p_parts, p_keys, range(len(p_parts)), strict=True))[: ALTERNATIVES + 1]
    (cheapest_p, cheapest_key, cheapest_j), *other_ps = p_ranked
    totals = TransferShare.totals(shares, cheapest_p)
    partner: dict[int, tuple[_PrefillKey, int]] = {}  # D -> its cheapest P, if not that one
    if (gpu := p_gpus[cheapest_j]) and gpu in d_gpus:
        # a D on that P's device takes turns with it: its cheapest pair is that P in turns or
        # the cheapest P elsewhere (each grows with P's part: exact, and still O(P + D)), the
        # first of the cheapest few on another device, else the cheapest of all the others
        away = next((entry for entry in other_ps if p_gpus[entry[2]] != gpu), None)
        if away is None and len(p_parts) > len(p_ranked):
            away = min(
                (
                    (cost, key, j)
                    for cost, key, j in zip(p_parts, p_keys, range(len(p_parts)), strict=True)
                    if p_gpus[j] != gpu
                ),
                default=None,
            )
        for i, d_gpu in enumerate(d_gpus):
            if d_gpu == gpu:
                share = TransferShare(*shares[i])
                totals[i] = share.in_turns(cheapest_p)
                if away is not None and (apart := share.total(away[0])) < totals[i]:
                    totals[i], partner[i] = apart, (away[1], away[2])
    d_ranked = sorted(zip(totals, d_keys, range(len(d_keys)), strict=True))[: ALTERNATIVES + 1]
    # each D's cheapest pair has its total already
    if partner:
        ranked += [
            (cost, rank, d_key, *partner.get(i, (cheapest_key, cheapest_j)), i)
            for cost, d_key, i in d_ranked
        ]
    else:
        ranked += [(cost, rank, d_key, cheapest_key, cheapest_j, i) for cost, d_key, i in d_ranked]
    if not other_ps:
        return
    # the other P's pairs with those D, each no dearer than the cheapest few so far: a pair
    # costs no less than that D's cheapest pair, nor than its ``TransferShare.total``, which
    # grows with the P part (rounding included; in turns, P's part holds D's queue: no less)
    limit = (
        sorted([entry[0] for entry in ranked])[ALTERNATIVES]
        if len(ranked) > ALTERNATIVES
        else math.inf
    )
    for total, d_key, i in d_ranked:
        if total > limit:
            continue
        d_gpu = d_gpus[i]
        fixed, tail, wait = shares[i]
        for p_cost, p_key, j in other_ps:  # by P's part, rising
            cost = fixed + (wait if wait > (part := p_cost + tail) else part)  # total, inline
            if cost > limit:  # the next P's pair with this D costs no less
                break
            if d_gpu and d_gpu == p_gpus[j]:  # TransferShare.in_turns, inline
                cost = fixed + p_cost + tail
                if cost > limit:
                    continue
            if not partner or j != partner.get(i, (None, -1))[1]:  # that pair: in already
                ranked.append((cost, rank, d_key, p_key, j, i))


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
