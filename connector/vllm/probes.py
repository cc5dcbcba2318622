"""Liveness probes of the decode side: what D does when a prefill peer falls silent.

A P that never acknowledged our abort, or whose heartbeat lease ended (the worker service names
it a suspect), is probed on its side channel from a short-lived thread; a side channel that no
longer answers means that P rank is dead, so nothing of it can land in our blocks any more:
``transport.peer_lost`` quiesces its transfers and the receives settle (docs/design.md,
correctness rule 3).

``ProbingMixin`` is part of ``DecodeSide`` (it uses the side's lock, transport, runtime and
transfer table); it is kept apart to keep each module one concern.

Threading model: ``_probe_suspects`` runs on the engine thread under the side's lock and starts
the probe threads; each probe thread takes the lock to report and wakes the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from kvpush.connector.sidechannel import TransportError, fetch_peer
from kvpush.connector.transfer import TransferState
from kvpush.connector.vllm.incoming import Incoming, IncomingState

if TYPE_CHECKING:
    from kvpush.connector.params import ConnectorSettings
    from kvpush.connector.transport import KvTransport
    from kvpush.connector.vllm.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class ProbingMixin:
    settings: ConnectorSettings
    transport: KvTransport
    runtime: WorkerRuntime
    lock: threading.RLock
    _by_tid: dict[str, Incoming]
    _probing: set[str]

    if TYPE_CHECKING:

        def _settle(self, inc: Incoming, state: TransferState) -> None: ...

    def _peer_alive(self, address: str) -> bool:
        """Does the side channel at ``address`` still answer (1 s)? Runs off the engine thread."""
        config = self.transport.config
        try:
            fetch_peer(address, config.compat, "kvpush-probe", 1.0, token=config.token)
        except TransportError:
            return False
        except Exception:  # anything else is not proof of death
            return True
        return True

    def _probe(self, addresses: list[str], inc: Incoming | None = None) -> None:
        """Off the engine thread: a P rank whose side channel is gone is dead and nothing of it
        can land, so its transfers quiesce (``peer_lost``) and a pull that got no KvReady from
        it (nothing posted) fails. ``inc``: the receive whose abort went unanswered (each rank
        it depends on is probed; while one answers, its ack is waited for again)."""
        dead = [address for address in addresses if not self._peer_alive(address)]
        with self.lock:
            if inc is None:
                self._probing.difference_update(addresses)
            for address in dead:
                log.warning("prefill at %s is gone: its transfers fail now", address)
                self.transport.peer_lost(address)
                for waiting in self._by_tid.values():
                    if address in waiting.peers and waiting.state is IncomingState.WAITING:
                        self._settle(waiting, TransferState.FAILED)
            if inc is not None:
                inc.probing = False
                if len(dead) < len(addresses):
                    inc.abort_sent_at = time.monotonic()
                    self.runtime.wake_at(inc.abort_sent_at + self.settings.abort_ack_timeout_s)
        self.runtime.notify()

    def _probe_later(self, inc: Incoming) -> None:
        """Probe every P rank ``inc`` depends on, off the engine thread."""
        inc.probing = True
        threading.Thread(target=self._probe, args=(inc.peers, inc), daemon=True).start()

    def _probe_suspects(self) -> None:
        """Probe each suspected peer we receive from, once at a time (off the engine thread)."""
        for address in self.runtime.take_suspects():
            if address in self._probing or not any(
                address in inc.peers and not inc.settled for inc in self._by_tid.values()
            ):
                continue
            self._probing.add(address)
            threading.Thread(target=self._probe, args=([address],), daemon=True).start()
