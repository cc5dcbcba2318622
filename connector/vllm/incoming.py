"""One receive of the decode side: ``Incoming`` and its states.

States (one transition method, ``Incoming.advance``)::

    WAITING --> RECEIVING --> ABORTING --> SETTLED
       |            |                        ^
       +------------+------------------------+

WAITING: pull mode before any P rank's KvReady (nothing posted yet). RECEIVING: push announced
and expected, or a pull READ posted (``legs``: one per P rank holding our heads). ABORTING: we
aborted a started receive and wait for P's AbortAck, its notice, its death, or (pull) our own
READs to quiesce. SETTLED: a quiesced outcome (``outcome``); reported once (a receive that
asked for P's first token and landed: once that token came, or ``first_token_wait_s`` later).

Threading model: none; ``DecodeSide`` owns these objects and changes them under its lock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.connector.integrity import Outcome
from kvpush.connector.params import DecodeWork
from kvpush.connector.transfer import TransferState
from kvpush.connector.vllm.side import Legs, check_transition
from kvpush.schemas.messages import FirstToken


class IncomingState(str, enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"
    ABORTING = "aborting"
    SETTLED = "settled"


_I = IncomingState
_ALLOWED: dict[IncomingState, frozenset[IncomingState]] = {
    _I.WAITING: frozenset({_I.RECEIVING, _I.SETTLED}),
    _I.RECEIVING: frozenset({_I.ABORTING, _I.SETTLED}),
    _I.ABORTING: frozenset({_I.SETTLED}),
    _I.SETTLED: frozenset(),
}


@dataclass(eq=False)
class Incoming:
    work: DecodeWork
    deadline: float
    legs: Legs  # pull: our READ of each P rank
    peer: str | None = None  # P's side channel once known (pull: KvReady; push: its WRITE)
    writers: list[str] = field(default_factory=list)  # every P rank's holding our heads
    state: IncomingState = IncomingState.WAITING
    abort_sent_at: float | None = None  # set when we aborted (ABORTING, or WAITING -> SETTLED)
    probing: bool = False
    silent_since: float | None = None  # a P rank it depends on first found SILENT (probes.py)
    outcome: TransferState | None = None  # set with SETTLED
    failed: bool = False
    request_ended: bool = False
    waiting_since_ns: int = 0  # unix ns: blocks announced (push) / receive set up (pull)
    prefill_token: FirstToken | None = None  # P's sampled token, when the request asked for it
    token_due: float | None = None  # settled DONE without it: reported without it from then
    ready_sums: dict[int, list[int] | None] = field(default_factory=dict)  # pull: KvReady's
    integrity: Outcome | None = None  # what verifying the landed KV concluded (verify.py)
    integrity_detail: str = ""
    stale: int = 0  # words of another allocation of our blocks, dropped

    def advance(self, new: IncomingState, outcome: TransferState | None = None) -> None:
        """The one state transition (``InvalidTransition`` if the diagram has no such edge)."""
        check_transition(_ALLOWED, self.state, new, f"incoming {self.work.params.transfer_id}")
        self.state = new
        if new is IncomingState.SETTLED:
            self.outcome = outcome
            self.failed = outcome is not TransferState.DONE

    @property
    def started(self) -> bool:
        """Something was posted or expected: only P's word (or death) can end it now."""
        return self.state in (IncomingState.RECEIVING, IncomingState.ABORTING)

    @property
    def peers(self) -> list[str]:
        """The P side channels this receive depends on (to probe when P falls silent)."""
        return self.writers or ([self.peer] if self.peer else [])

    @property
    def settled(self) -> bool:
        return self.state is IncomingState.SETTLED

    @property
    def wants_prefill_token(self) -> bool:
        """Landed, asked for P's first token, which has not come (and is still wanted)."""
        asked = self.work.params.first_token_from_prefill and self.prefill_token is None
        return asked and not self.failed and not self.request_ended
