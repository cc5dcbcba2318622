"""The soak's killer: which fault comes next, on which worker, and one fault played out.

``FaultPlan.next`` picks the next fault from the run's kinds (``--faults``): a nats-server
restart (``restart_nats``) comes exactly once per run, at the first fault past a point drawn
between 20% and 60% of the load (or at the last fault, should the run end sooner); the other
kinds come in rounds, each shuffled, so every kind gets its turn; the victim of a kill or stop
is a random worker of its role. Everything is drawn from the fault-only random stream (the run's
``--seed``): a seed gives the same sequence of kinds and victims.

``Killer.play`` injects one fault and measures it (``measure.FaultRecord``): ``kill_<role>``
SIGKILLs the victim and starts it again (a new epoch); ``stop_<role>`` SIGSTOPs it past its
lease (``stop_seconds``: two leases and a second), then SIGCONTs it (it finds its heartbeats
stalled, aborts what it held and rejoins); ``restart_nats`` restarts nats-server. While it
plays, a task polls the gateway's membership every ``POLL_S`` for the victim gone (detection),
then for the victim back (rejoin); after that, ``Played.back`` waits for the victim's first
finished request, until the fault's window ends (``Played.close``).

Threading model: asyncio, on the soak's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvpush.benchmarks.soak.checks import FAULTS, role_of_fault
from kvpush.benchmarks.soak.stack import SoakStack

POLL_S: Final = 0.05
DETECT_LIMIT_S: Final = 10.0  # a victim not counted gone by then: never noticed
REJOIN_LIMIT_S: Final = 30.0  # a victim not counted alive again by then (after its restart
# or SIGCONT): the run stops with a failure
NATS: Final = "restart_nats"
NATS_SPAN: Final = (0.2, 0.6)  # the share of the load after which nats-server restarts


def stop_seconds(lease_s: float) -> float:
    """How long a stopped worker stays stopped: well past its lease."""
    return 2 * lease_s + 1.0


def check_kinds(kinds: Sequence[str], prefill: int, decode: int) -> None:
    """Raise ValueError for an unknown kind, none at all, or a stack without a victim."""
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise ValueError(f"faults must be some of {', '.join(FAULTS)}, not {kinds!r}")
    if prefill < 1 or decode < 1:
        raise ValueError("the soak needs at least one prefill and one decode worker")


class FaultPlan:
    """See the module docstring."""

    def __init__(
        self,
        kinds: Sequence[str],
        workers: dict[str, list[str]],  # role -> worker ids
        rng: random.Random,
        load_s: float,
    ) -> None:
        self.kinds = tuple(dict.fromkeys(kinds))
        self.workers, self.rng = workers, rng
        self.nats_at_s = rng.uniform(*NATS_SPAN) * load_s if NATS in self.kinds else None
        self.nats_done = False
        self._round: list[str] = []

    def next(self, elapsed_s: float, last: bool) -> tuple[str, str]:
        """The next fault's kind and victim ("" for none); ``last``: no fault can follow."""
        if self.nats_at_s is not None and not self.nats_done:
            others = [k for k in self.kinds if k != NATS]
            if elapsed_s >= self.nats_at_s or last or not others:
                self.nats_done = True
                return NATS, ""
        if not self._round:
            self._round = [k for k in self.kinds if k != NATS]
            self.rng.shuffle(self._round)
        kind = self._round.pop()
        role = role_of_fault(kind)
        return kind, (self.rng.choice(self.workers[role]) if role else "")


@dataclass
class Played:
    """One fault as it played out (times from ``at``, ``time.monotonic()``)."""

    kind: str
    victim: str
    at: float
    detect_s: float | None = None
    rejoin_s: float | None = None
    back: asyncio.Task[float] | None = None

    async def close(self) -> float | None:
        """The fault's window ended: the victim's first finished request, or None."""
        if self.back is None:
            return None
        if not self.back.done():
            self.back.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.back
        return None if self.back.cancelled() else self.back.result()


class Killer:
    """Injects and measures one fault on ``stack``; see the module docstring."""

    def __init__(self, stack: SoakStack) -> None:
        self.stack = stack

    async def play(self, kind: str, victim: str) -> Played:
        stack = self.stack
        if kind == NATS:
            played = Played(kind, victim, time.monotonic())
            await stack.restart_nats()
            return played
        old = stack.gateway_epoch(victim)
        played = Played(kind, victim, time.monotonic())
        detect = asyncio.create_task(self._detect(played, old), name=f"detect-{victim}")
        try:
            if kind.startswith("kill_"):
                await stack.kill(victim)
            else:
                await stack.pause(victim, stop_seconds(stack.lease_s(victim)))
            await detect
        finally:
            if not detect.done():
                detect.cancel()
        rejoined = await self._rejoin(played, old if kind.startswith("kill_") else None)
        played.back = asyncio.create_task(self._back(played, rejoined), name=f"back-{victim}")
        return played

    async def _detect(self, played: Played, old: int | None) -> None:
        while (waited := time.monotonic() - played.at) < DETECT_LIMIT_S:
            epoch = self.stack.gateway_epoch(played.victim)
            if epoch is None or epoch != old:
                played.detect_s = round(waited, 3)
                return
            await asyncio.sleep(POLL_S)

    async def _rejoin(self, played: Played, old: int | None) -> float:
        """Until the gateway counts the victim alive again (with an epoch other than ``old``
        when it was restarted); when it did."""
        deadline = time.monotonic() + REJOIN_LIMIT_S
        while True:
            epoch = self.stack.gateway_epoch(played.victim)
            now = time.monotonic()
            if epoch is not None and epoch != old:
                played.rejoin_s = round(now - played.at, 3)
                return now
            if now > deadline:
                raise RuntimeError(
                    f"{played.victim} was not alive again at the gateway {REJOIN_LIMIT_S:g} s "
                    f"after its {played.kind}"
                )
            await asyncio.sleep(POLL_S)

    async def _back(self, played: Played, rejoined: float) -> float:
        served = self.stack.watch.served
        while served.get(played.victim, 0.0) <= rejoined:
            await asyncio.sleep(POLL_S)
        return round(served[played.victim] - played.at, 3)
