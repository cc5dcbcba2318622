"""``TransportConfig``: what one ``KvTransport`` (transport.py) is built with.

Identity (worker id, compatibility facts, epoch), the side channel's bind and advertised
address, the NIXL backend and its parameters, and the bounds of the transfer table.

Threading model: none; a frozen value, read by the transport and its parts.
"""

from __future__ import annotations

import msgspec

from kvpush.connector.agent import Backend
from kvpush.connector.peering import CompatInfo


class TransportConfig(msgspec.Struct, frozen=True):
    worker_id: str
    compat: CompatInfo
    epoch: int = 0  # 0: derive from the clock at start
    host: str = "127.0.0.1"  # side-channel bind host
    port: int = 0  # 0: ephemeral
    advertise_host: str | None = None
    backend: Backend = Backend.UCX
    backend_params: dict[str, str] = {}  # e.g. {"ucx_error_handling_mode": "peer"}
    ucx_env: dict[str, str] = {}  # UCX_* variables, set (if unset) before the agent is built
    handshake_timeout_s: float = 5.0
    cancel_grace_s: float = 5.0  # in-flight requests of an ended transfer are cancelled after
    prep_limit: int = 1 << 18  # largest per-block prepped list; bigger pools post coalesced rows
    max_transfers: int = 4096  # bound of the transfer table; start/expect raise beyond it
    max_early_notices: int = 4096  # notices for transfers not yet expected; oldest dropped
    telemetry: bool = False
    token: str | None = None  # shared side-channel secret (see sidechannel.py); never logged

    def __repr__(self) -> str:  # keep the token out of logs and tracebacks
        return f"TransportConfig(worker_id={self.worker_id!r}, host={self.host!r}, ...)"
