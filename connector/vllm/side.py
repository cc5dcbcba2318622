"""What the prefill and the decode side of the worker half share: the transfers in flight by id,
the bus messages that arrived before their transfer (bounded), this half's TP rank (a side
takes only its rank pair's messages: ``mine``), and the checked state transition of their
per-transfer objects.

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
from typing import Generic, TypeVar

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.transfer import InvalidTransition
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime

Entry = TypeVar("Entry")
Message = TypeVar("Message")
State = TypeVar("State", bound=enum.Enum)


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
        rank: int,
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
        """Is ``message`` for this rank? (``rank`` None: an Abort for every rank.)"""
        rank = getattr(message, "rank", 0)
        return rank is None or rank == self.rank

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

    def _apply_early(self, transfer_id: str, entry: Entry) -> None:
        """Hand ``entry`` the message that came before it, if one did."""
        early = self._early.pop(transfer_id, None)
        if early is not None:
            self._apply(entry, early)

    def _forget(self, transfer_id: str) -> None:
        del self._by_tid[transfer_id]
