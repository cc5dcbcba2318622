"""What the prefill and the decode side of the worker half share: the transfers in flight by id,
the bus messages that arrived before their transfer (bounded), this half's TP rank (``Rank``: a
side takes only the messages of peer ranks whose KV heads overlap its own, ``mine``), and the
checked state transition of their per-transfer objects.

``SideBase._deliver`` is the bus-thread entry: a message for a known transfer is applied, one for
an unknown transfer is kept in ``_early`` (at most ``max_pending_announcements``, oldest dropped)
until ``_track`` registers the transfer and ``_apply_early`` hands it over. ``_forget`` ends the
tracking.

Threading model: every method is called with ``self.lock`` held (an RLock: the bus thread and
the engine thread both enter).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.transfer import InvalidTransition
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime

Entry = TypeVar("Entry")
Message = TypeVar("Message")
State = TypeVar("State", bound=enum.Enum)


@dataclass(frozen=True)
class Rank:
    """A worker half's place in its engine: TP rank ``index`` of ``size``. Rank r of size t
    holds KV heads [r/t, (r+1)/t) of the model's (vLLM shards heads evenly, in rank order)."""

    index: int = 0
    size: int = 1

    def overlaps(self, index: int, size: int) -> bool:
        """Do rank ``index`` of ``size`` (a peer's) and this rank hold some of the same heads?
        Same TP: only the same rank. P of 2 and D of 1: D's rank 0 and both of P's."""
        return (
            self.index * size < (index + 1) * self.size
            and index * self.size < (self.index + 1) * size
        )


def check_transition(
    allowed: Mapping[State, frozenset[State]], current: State, new: State, what: str
) -> None:
    """Raise ``InvalidTransition`` unless ``current -> new`` is in ``allowed``."""
    if new not in allowed[current]:
        raise InvalidTransition(f"{what}: {current.value} -> {new.value}")


class SideBase(Generic[Entry, Message]):
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: KvTransport,
        bus: BusThread,
        runtime: WorkerRuntime,
        rank: Rank,
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.transport = transport
        self.bus = bus
        self.runtime = runtime
        self.lock = threading.RLock()
        self._by_tid: dict[str, Entry] = {}
        self._early: BoundedDict[str, Message] = BoundedDict(settings.max_pending_announcements)

    def mine(self, message: object) -> bool:
        """Is ``message`` (from a peer rank) for this rank? (``rank`` None: every rank.)"""
        index = getattr(message, "rank", 0)
        return index is None or self.rank.overlaps(index, getattr(message, "tp", 1))

    def _apply(self, entry: Entry, message: Message) -> None:
        raise NotImplementedError

    def _deliver(self, transfer_id: str, message: Message) -> bool:
        """Apply ``message`` to its transfer; False (kept for later) when it is not known yet."""
        entry = self._by_tid.get(transfer_id)
        if entry is None:
            self._early[transfer_id] = message
            return False
        self._apply(entry, message)
        return True

    def _track(self, transfer_id: str, entry: Entry) -> None:
        self._by_tid[transfer_id] = entry
        deadline = getattr(entry, "deadline", None)
        if deadline is not None:  # a step must come then to give up on it
            self.runtime.wake_at(deadline)

    def _apply_early(self, transfer_id: str, entry: Entry) -> None:
        """Hand ``entry`` the message that came before it, if one did."""
        early = self._early.pop(transfer_id, None)
        if early is not None:
            self._apply(entry, early)

    def _forget(self, transfer_id: str) -> None:
        del self._by_tid[transfer_id]
