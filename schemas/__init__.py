"""kvpush bus contract, v1: typed messages, subjects, one decode path, generated schema files.

``kvpush.schemas.messages`` holds the structs, ``subjects`` the subject builders and parser,
``codec`` the single encode/decode path (``decode(subject, payload)`` raises ``MessageError``),
``export`` the JSON Schema / AsyncAPI generator behind ``kvpush schemas export``.
"""

from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage, MessageError, MessageErrorKind, decode, encode
from kvpush.schemas.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    BlocksAnnounced,
    CacheEvents,
    CacheSync,
    FailReason,
    FinishReason,
    FirstToken,
    KvFailed,
    KvPushed,
    KvPushing,
    KvReady,
    LayerTiming,
    RequestEvent,
    SamplingSpec,
    Timing,
    TokenChunk,
    TransferMode,
    Usage,
    WorkerHeartbeat,
    WorkerRole,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "AbortAck",
    "BlocksAnnounced",
    "BusMessage",
    "CacheEvents",
    "CacheSync",
    "FailReason",
    "FinishReason",
    "FirstToken",
    "KvFailed",
    "KvPushed",
    "KvPushing",
    "KvReady",
    "LayerTiming",
    "MessageError",
    "MessageErrorKind",
    "RequestEvent",
    "SamplingSpec",
    "Timing",
    "TokenChunk",
    "TransferMode",
    "Usage",
    "WorkerHeartbeat",
    "WorkerRole",
    "decode",
    "encode",
    "subjects",
]
