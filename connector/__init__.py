"""kvpush connector: KV movement between engines.

Two layers: a vLLM-free transport (NIXL agent, KV pool layout, side channel, transfer state
machine) and a vLLM adapter (KVConnectorBase_V1 subclass) that drives it.
"""

from kvpush.connector.agent import AgentError, Backend
from kvpush.connector.layout import (
    CompatInfo,
    KvRegion,
    MemType,
    PoolLayout,
    compat_hash,
    ids_to_runs,
    pool_layout,
    runs_to_ids,
)
from kvpush.connector.poller import Poller
from kvpush.connector.sidechannel import HandshakeError, IncompatiblePeerError, TransportError
from kvpush.connector.transfer import Role, TransferEvent, TransferState
from kvpush.connector.transport import KvTransport, TransportConfig

__all__ = [
    "AgentError",
    "Backend",
    "CompatInfo",
    "HandshakeError",
    "IncompatiblePeerError",
    "KvRegion",
    "KvTransport",
    "MemType",
    "Poller",
    "PoolLayout",
    "Role",
    "TransferEvent",
    "TransferState",
    "TransportConfig",
    "TransportError",
    "compat_hash",
    "ids_to_runs",
    "pool_layout",
    "runs_to_ids",
]
