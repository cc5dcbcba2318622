"""Liveness probes of the decode side: what D does when a prefill peer falls silent.

A P that never acknowledged our abort, or whose heartbeat lease ended (the worker service names
it a suspect), is probed on its side channel from a short-lived thread. The probe tells three
answers apart (``PeerState``): the side channel answers (ALIVE: wait for P's word again); its
port refuses connections (DEAD: no process listens, so nothing of it can land in our blocks any
more: ``transport.peer_lost`` quiesces its transfers and the receives settle, docs/design.md,
correctness rule 3); or the port accepts but nothing answers (SILENT: a stopped or hung process,
SIGSTOP, a swap storm, a host we cannot reach, which may still post WRITEs when it resumes).
A SILENT peer is not dead: D keeps the blocks and probes again after each ``abort_ack_timeout_s``
(a resumed P handles our abort and acknowledges it once its WRITEs are done); only a peer
SILENT for ``peer_silent_dead_s`` (30 s by default) on end is presumed dead. The request
itself need not wait: the gateway moves it off a P that left the membership (to another P, or
to LOCAL on a decode worker, in fresh blocks).

``ProbingMixin`` is part of ``DecodeSide`` (it uses the side's lock, transport, runtime and
transfer table); it is kept apart to keep each module one concern.

Threading model: ``_probe_suspects`` runs on the engine thread under the side's lock and starts
the probe threads; each probe thread takes the lock to report and wakes the engine.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvpush.connector.sidechannel import TransportError, fetch_peer
from kvpush.connector.transfer import TransferState
from kvpush.connector.vllm.incoming import Incoming, IncomingState

if TYPE_CHECKING:
    from kvpush.connector.params import ConnectorSettings
    from kvpush.connector.transport import KvTransport
    from kvpush.connector.vllm.runtime import WorkerRuntime

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 1.0  # how long a side channel has to answer a probe


class PeerState(enum.Enum):
    """What a probe of a P rank's side channel found."""

    ALIVE = "alive"  # it answered
    SILENT = "silent"  # its port accepts connections (or cannot be reached) but nothing answers
    DEAD = "dead"  # its port refuses connections: no process listens there


def port_refuses(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Does ``tcp://host:port`` refuse a TCP connection (nothing listens)? A timeout or an
    unreachable host is no proof of death: False."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class ProbingMixin:
    settings: ConnectorSettings
    transport: KvTransport
    runtime: WorkerRuntime
    lock: threading.RLock
    _by_tid: dict[str, Incoming]
    _probing: set[str]

    if TYPE_CHECKING:

        def _settle(self, inc: Incoming, state: TransferState) -> None: ...

    def _peer_state(self, address: str) -> PeerState:
        """Probe the side channel at ``address`` (``PROBE_TIMEOUT_S``). Off the engine thread."""
        config = self.transport.config
        try:
            fetch_peer(address, config.compat, "kvpush-probe", PROBE_TIMEOUT_S, token=config.token)
        except TransportError:
            return PeerState.DEAD if port_refuses(address) else PeerState.SILENT
        except Exception:  # anything else is not proof of death
            return PeerState.ALIVE
        return PeerState.ALIVE

    def _probe(self, addresses: list[str], inc: Incoming | None = None) -> None:
        """Off the engine thread: a P rank whose side channel port refuses is dead and nothing
        of it can land, so its transfers quiesce (``peer_lost``) and a pull that got no KvReady
        from it (nothing posted) fails. ``inc``: the receive whose abort went unanswered (each
        rank it depends on is probed; while none is dead, its ack is waited for again, unless
        a rank stayed SILENT for ``peer_silent_dead_s``: then it is presumed dead)."""
        states = {address: self._peer_state(address) for address in addresses}
        now = time.monotonic()
        with self.lock:
            if inc is None:
                self._probing.difference_update(addresses)
            silent = [a for a, state in states.items() if state is PeerState.SILENT]
            dead = [a for a, state in states.items() if state is PeerState.DEAD]
            if inc is not None and silent:
                inc.silent_since = inc.silent_since or now
                if now - inc.silent_since >= self.settings.peer_silent_dead_s:
                    log.warning(
                        "prefill at %s silent for %.0f s: presumed dead",
                        ", ".join(silent),
                        now - inc.silent_since,
                    )
                    dead += silent
            elif inc is not None:
                inc.silent_since = None
            for address in silent:
                if address not in dead:
                    log.warning(
                        "prefill at %s does not answer but listens: keeping its blocks", address
                    )
            for address in dead:
                log.warning("prefill at %s is gone: its transfers fail now", address)
                self.transport.peer_lost(address)
                for waiting in self._by_tid.values():
                    if address in waiting.peers and waiting.state is IncomingState.WAITING:
                        self._settle(waiting, TransferState.FAILED)
            if inc is not None:
                inc.probing = False
                if len(dead) < len(addresses):
                    inc.abort_sent_at = now
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
