"""The soak's measurements of each fault: detection, recovery, the victim back, migrations.

One ``FaultRecord`` per injected fault; all times in seconds from the fault (the signal sent,
nats-server's restart begun, a burst's first extra request):

- ``detect_s`` (a killed or stopped worker): until the gateway's membership counts the victim
  gone: the first 50 ms poll at which ``registry.epoch(role, id)``, the look-up its routing and
  its stalled requests make, is None or another epoch. None: never within the poll's limit (a
  miss); not measured for other faults (``DETECTION_KINDS``).
- ``rejoin_s``: until the gateway counts the victim alive again (a killed worker: started
  again, its new epoch's heartbeat heard; a stopped one: continued and heard again).
- ``back_s``: until the victim finished a request again after it rejoined (a decode worker:
  an answer it ended; a prefill worker: an answer whose KV it pushed or had pulled). None: not
  before the fault's window ended.
- ``recovery_s``: until full throughput again. Throughput is token-exact 200s per second,
  counted when the client got them. The baseline is the rate over the load interval before
  the fault (the previous quiesce's end to this fault's quiesce). From the fault to the end of
  its window (the quiesce after the recovery load), every window of ``rate_window_s`` starting
  on a ``STEP_S`` grid is rated; ``recovery_s`` is the start of the first window from which on
  every window holds at least ``RECOVERED_SHARE`` (90%) of the baseline: 0 when the rate never
  dipped, None when the last window is still below it (not back within the fault's window) or
  the window is shorter than one rate window.
- ``migrations``: the gateway's ``kvpush_gateway_migrations_total`` per ``lost`` label, from
  just before the fault to after the quiesce that ends its window (labels that did not move
  left out).
- ``profile``: the token-exact 200s of each whole second from the fault to the end of its
  window (the JSON's raw data for the rates above).

``summarize`` gives one ``FaultSummary`` per fault kind; ``detection_failures`` is the part of
the verdict these measurements decide (a kill or stop the gateway never noticed, or noticed
later than the target).

Threading model: none (pure functions and immutable records; ``Throughput`` is a plain object
used from the soak's event loop).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from typing import Final

import msgspec

STEP_S: Final = 0.25
RECOVERED_SHARE: Final = 0.9
DETECTION_KINDS: Final = ("kill_prefill", "kill_decode", "stop_prefill", "stop_decode")
MAX_COMPLETIONS: Final = 1_000_000  # completion times kept (a 30-minute run has ~10k)


class FaultRecord(msgspec.Struct, frozen=True):
    kind: str
    victim: str  # "" for restart_nats and burst
    at_s: float  # when, seconds after the load began
    in_flight: int  # gateway requests in flight at the fault
    window_s: float  # from the fault to the quiesce that ended its window
    baseline_rate: float  # token-exact 200s per second in the load interval before it
    fault_rate: float  # ... over its window
    detect_s: float | None = None
    rejoin_s: float | None = None
    back_s: float | None = None
    recovery_s: float | None = None
    migrations: dict[str, int] = {}  # lost label -> moves during the fault's window
    profile: list[int] = []  # token-exact 200s per second of the window


class FaultSummary(msgspec.Struct, frozen=True):
    kind: str
    count: int
    detect_median_s: float | None
    detect_max_s: float | None
    undetected: int  # kills / stops the gateway never counted gone
    rejoin_median_s: float | None
    back_median_s: float | None
    back_max_s: float | None
    not_served_again: int  # victims that finished no request within their fault's window
    recovery_median_s: float | None
    recovery_max_s: float | None
    not_recovered: int  # windows that ended below 90% of the baseline
    rate_share: float | None  # the windows' rate over their baselines, summed
    migrations: dict[str, int]


class Throughput:
    """When each token-exact 200 reached its client (``time.monotonic()``), in order."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def add(self, at: float) -> None:
        if len(self.times) >= MAX_COMPLETIONS:
            del self.times[: MAX_COMPLETIONS // 2]
        bisect.insort(self.times, at)

    def count(self, start: float, end: float) -> int:
        """Completions in ``[start, end)``."""
        return bisect.bisect_left(self.times, end) - bisect.bisect_left(self.times, start)

    def rate(self, start: float, end: float) -> float:
        return self.count(start, end) / (end - start) if end > start else 0.0

    def profile(self, start: float, end: float, step_s: float = 1.0) -> list[int]:
        """Completions in each whole ``step_s`` from ``start`` to ``end``."""
        steps = max(0, int((end - start) / step_s + 1e-9))
        edges = [start + k * step_s for k in range(steps + 1)]
        return [self.count(a, b) for a, b in itertools.pairwise(edges)]


def recovery_time(
    throughput: Throughput, fault: float, end: float, baseline: float, window_s: float
) -> float | None:
    """``recovery_s`` (see the module docstring) of a fault at ``fault`` whose window ends at
    ``end``."""
    steps = int((end - fault - window_s) / STEP_S + 1e-9)
    if steps < 0 or window_s <= 0:
        return None
    floor = RECOVERED_SHARE * baseline * window_s
    back: float | None = None
    for k in range(steps + 1):
        start = fault + k * STEP_S
        if throughput.count(start, start + window_s) >= floor:
            if back is None:
                back = k * STEP_S
        else:
            back = None
    return back


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _max(values: Sequence[float]) -> float | None:
    return round(max(values), 2) if values else None


def summarize(records: Sequence[FaultRecord]) -> list[FaultSummary]:
    """One summary per fault kind, in the order kinds first appear."""
    out = []
    for kind in dict.fromkeys(r.kind for r in records):
        mine = [r for r in records if r.kind == kind]
        detects = [r.detect_s for r in mine if r.detect_s is not None]
        rejoins = [r.rejoin_s for r in mine if r.rejoin_s is not None]
        backs = [r.back_s for r in mine if r.back_s is not None]
        recoveries = [r.recovery_s for r in mine if r.recovery_s is not None]
        migrations: dict[str, int] = {}
        for record in mine:
            for lost, n in record.migrations.items():
                migrations[lost] = migrations.get(lost, 0) + n
        baseline = sum(r.baseline_rate for r in mine)
        victims = kind in DETECTION_KINDS
        out.append(
            FaultSummary(
                kind=kind,
                count=len(mine),
                detect_median_s=_median(detects),
                detect_max_s=_max(detects),
                undetected=len(mine) - len(detects) if victims else 0,
                rejoin_median_s=_median(rejoins),
                back_median_s=_median(backs),
                back_max_s=_max(backs),
                not_served_again=len(mine) - len(backs) if victims else 0,
                recovery_median_s=_median(recoveries),
                recovery_max_s=_max(recoveries),
                not_recovered=len(mine) - len(recoveries),
                rate_share=round(sum(r.fault_rate for r in mine) / baseline, 3)
                if baseline
                else None,
                migrations=dict(sorted(migrations.items())),
            )
        )
    return out


def detection_failures(records: Sequence[FaultRecord], target_s: float) -> list[str]:
    """Kills and stops the gateway never counted gone, or counted gone past ``target_s``."""
    out = []
    for r in records:
        if r.kind not in DETECTION_KINDS:
            continue
        if r.detect_s is None:
            out.append(f"{r.kind} of {r.victim} at {r.at_s:.0f} s: the gateway never noticed")
        elif r.detect_s > target_s:
            out.append(
                f"{r.kind} of {r.victim} at {r.at_s:.0f} s noticed after {r.detect_s:.2f} s "
                f"(target {target_s:g} s)"
            )
    return out
