"""The soak's books: judged requests by category and path, and KV blocks leaked per interval.

Requests: ``Tally.add(judgement, delivery, window, moved)`` counts each answer once (``moved``:
the gateway moved it to other workers on the way, counted apart among the token-exact ones);
``success_share`` is the token-exact 200s over every request but the client's own aborts
(those are neither a success nor a failure of the stack).

Blocks: the soak quiesces the stack (clients paused, every worker ``in_flight`` 0 and its free
block count stable) before each fault and again after the stack settled, and records an
``IdleSample`` per worker. The run is a chain of ``Interval``s between two consecutive
quiesces, labelled by the fault injected in it or ``LOAD`` (load only). ``interval_leaks``:

- a worker with the same epoch at both ends leaked ``free(before) - free(after)`` blocks;
- a worker restarted inside the interval (new epoch) loses its old incarnation's blocks with
  its process: that incarnation's leaks are unmeasurable, and its restart proves nothing. What
  is measured for it is the new incarnation, which starts with every block free, so it leaked
  ``total(after) - free(after)``; the check that matters for such a fault is the *other*
  worker's (D's blocks must all come back after P was killed mid-push, and the other way).

``summarize_leaks`` sums and maxes the leaks per interval kind, survivors and restarted
incarnations apart. Any positive leak, or a sample that never went idle (``stable`` False:
requests stuck in flight or a count that kept moving until the settle timeout), fails the run.

Threading model: none (plain objects, used from the soak's event loop).
"""

from __future__ import annotations

from collections import Counter

import msgspec

from kvpush.benchmarks.soak.checks import Category, Delivery, Judgement

PATHS = (
    "local", "push/received", "push/cached", "push/fallback",
    "pull/received", "pull/cached", "pull/fallback", "unknown",
)  # fmt: skip


class IdleSample(msgspec.Struct, frozen=True):
    worker: str
    epoch: int
    free: int
    total: int
    in_flight: int
    stable: bool  # in_flight 0 and the same free count on consecutive heartbeats
    waited_s: float


class WorkerLeak(msgspec.Struct, frozen=True):
    worker: str
    restarted: bool  # new epoch inside the interval: ``leaked`` is the new incarnation's
    leaked: int


class Interval(msgspec.Struct, frozen=True):
    kind: str  # a fault kind, or LOAD
    at_s: float  # when it started, seconds after the load began
    in_flight: int  # gateway requests in flight when the fault was injected (0 for LOAD)
    before: list[IdleSample]
    after: list[IdleSample]
    leaks: list[WorkerLeak]


class LeakSummary(msgspec.Struct, frozen=True):
    kind: str
    intervals: int
    in_flight: int  # requests in flight at the injections, summed
    survivors: dict[str, int]  # worker -> intervals it lived through (measured across)
    restarted: dict[str, int]  # worker -> intervals it was restarted in
    leaked_sum: int  # survivors
    leaked_max: int
    restarted_leaked_sum: int  # new incarnations
    restarted_leaked_max: int


def interval_leaks(before: list[IdleSample], after: list[IdleSample]) -> list[WorkerLeak]:
    """Blocks each worker leaked between two idle samples (see the module docstring)."""
    ends = {s.worker: s for s in after}
    leaks = []
    for start in before:
        end = ends.get(start.worker)
        if end is None:
            raise ValueError(f"no idle sample of {start.worker} after the interval")
        if end.epoch == start.epoch:
            leaks.append(WorkerLeak(start.worker, False, start.free - end.free))
        else:
            leaks.append(WorkerLeak(start.worker, True, end.total - end.free))
    return leaks


def make_interval(
    kind: str, at_s: float, in_flight: int, before: list[IdleSample], after: list[IdleSample]
) -> Interval:
    return Interval(kind, at_s, in_flight, before, after, interval_leaks(before, after))


def summarize_leaks(intervals: list[Interval]) -> list[LeakSummary]:
    """One summary per interval kind, in the order kinds first appear."""
    kinds = list(dict.fromkeys(i.kind for i in intervals))
    summaries = []
    for kind in kinds:
        mine = [i for i in intervals if i.kind == kind]
        survivors: Counter[str] = Counter()
        restarted: Counter[str] = Counter()
        kept: list[int] = []
        fresh: list[int] = []
        for interval in mine:
            for leak in interval.leaks:
                (restarted if leak.restarted else survivors)[leak.worker] += 1
                (fresh if leak.restarted else kept).append(leak.leaked)
        summaries.append(
            LeakSummary(
                kind=kind,
                intervals=len(mine),
                in_flight=sum(i.in_flight for i in mine),
                survivors=dict(sorted(survivors.items())),
                restarted=dict(sorted(restarted.items())),
                leaked_sum=sum(max(0, n) for n in kept),
                leaked_max=max([0, *kept]),
                restarted_leaked_sum=sum(max(0, n) for n in fresh),
                restarted_leaked_max=max([0, *fresh]),
            )
        )
    return summaries


def leak_failures(intervals: list[Interval]) -> list[str]:
    """Why the blocks fail the run: leaks, or samples that never went idle."""
    failures = []
    for interval in intervals:
        for leak in interval.leaks:
            if leak.leaked > 0:
                whose = "restarted incarnation of " if leak.restarted else ""
                failures.append(
                    f"{leak.leaked} block(s) leaked by the {whose}{leak.worker} across "
                    f"{interval.kind} at {interval.at_s:.0f} s"
                )
        for sample in (*interval.before, *interval.after):
            if not sample.stable:
                failures.append(
                    f"{sample.worker} never went idle around {interval.kind} at "
                    f"{interval.at_s:.0f} s (in flight {sample.in_flight}, "
                    f"free {sample.free}/{sample.total})"
                )
    return list(dict.fromkeys(failures))  # a sample ends one interval and starts the next


class PathCount(msgspec.Struct, frozen=True):
    path: str
    json: int  # token-exact, stream=false
    stream: int  # token-exact, streamed to [DONE]
    aborted: int  # client aborts whose ids so far were a prefix of the reference
    wrong: int


class ErrorKind(msgspec.Struct, frozen=True):
    window: str  # the fault being played out when the request was sent, or LOAD
    detail: str
    count: int
    expected: bool


class Tally:
    """Counts of judged answers; see the module docstring."""

    def __init__(self) -> None:
        self.categories: Counter[str] = Counter()
        self._paths: Counter[tuple[str, str]] = Counter()  # (path, json|stream|aborted|wrong)
        self._errors: Counter[tuple[str, str, bool]] = Counter()
        self._windows: Counter[tuple[str, str]] = Counter()  # (window, category)
        self.examples: list[str] = []  # the first unexpected answers and wrong ones, verbatim
        self.moved = 0  # token-exact 200s the gateway moved to other workers on the way

    def add(
        self, judgement: Judgement, delivery: Delivery, window: str, moved: bool = False
    ) -> None:
        category = judgement.category
        self.categories[category.value] += 1
        self.moved += category is Category.OK and moved
        self._windows[window, category.value] += 1
        if category is Category.OK:
            self._paths[judgement.path, delivery.value] += 1
        elif category is Category.ABORTED:
            self._paths[judgement.path, "aborted"] += 1
        elif category is Category.WRONG:
            self._paths[judgement.path, "wrong"] += 1
        if category in (Category.EXPECTED_ERROR, Category.UNEXPECTED):
            self._errors[window, judgement.detail, category is not Category.UNEXPECTED] += 1
        if category in (Category.WRONG, Category.UNEXPECTED) and len(self.examples) < 20:
            self.examples.append(f"{window} {delivery.value} {judgement.path}: {judgement.detail}")

    @property
    def sent(self) -> int:
        return sum(self.categories.values())

    def success_share(self) -> float:
        judged = self.sent - self.categories[Category.ABORTED.value]
        return self.categories[Category.OK.value] / judged if judged else 0.0

    def paths(self) -> list[PathCount]:
        return [
            PathCount(path, *(self._paths[path, k] for k in ("json", "stream", "aborted", "wrong")))
            for path in PATHS
            if any(self._paths[path, k] for k in ("json", "stream", "aborted", "wrong"))
        ]

    def windows(self) -> dict[str, dict[str, int]]:
        """Categories of the requests sent in each window (a fault kind, or LOAD)."""
        out: dict[str, dict[str, int]] = {}
        for (window, category), n in sorted(self._windows.items()):
            out.setdefault(window, {})[category] = n
        return out

    def errors(self) -> list[ErrorKind]:
        rows = [ErrorKind(w, d, n, e) for (w, d, e), n in self._errors.items()]
        return sorted(rows, key=lambda r: (r.expected, -r.count, r.window, r.detail))
