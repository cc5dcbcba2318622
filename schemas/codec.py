"""The one encode/decode path for bus messages.

``decode(subject, payload)`` parses a NATS message into the typed struct its subject carries and
raises ``MessageError`` (with a ``MessageErrorKind``) on anything else: bad subject, oversized
payload, invalid JSON, out-of-bound fields, a message type the subject does not carry, another
protocol version, or ids that contradict the subject. It never raises anything else.

Threading model: decoders are built once at import and are thread-safe (msgspec decoders hold
no mutable state).
"""

from __future__ import annotations

import enum
from typing import Final, Union

import msgspec

from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    ALL_MESSAGES,
    TAG_PREFIX,
    Abort,
    AbortAck,
    BlocksAnnounced,
    CacheEvents,
    CacheSync,
    FirstToken,
    KvFailed,
    KvPushed,
    KvPushing,
    KvReady,
    RequestEvent,
    TokenChunk,
    WorkerHeartbeat,
)
from kvpush.schemas.subjects import SubjectError, SubjectKind

MAX_PAYLOAD_BYTES: Final = 1024 * 1024  # nats-server's default max_payload

BusMessage = Union[ALL_MESSAGES]  # noqa: UP007  (a runtime union object for msgspec)


class MessageErrorKind(str, enum.Enum):
    SUBJECT = "subject"  # not a kvpush v1 subject
    TOO_LARGE = "too_large"  # payload over MAX_PAYLOAD_BYTES
    MALFORMED = "malformed"  # not JSON, or fields missing / wrong type / out of bounds
    WRONG_TYPE = "wrong_type"  # valid message, but not one this subject carries
    VERSION = "version"  # a kvpush message of another protocol version
    MISMATCH = "mismatch"  # ids in the payload contradict the subject


class MessageError(ValueError):
    """A bus message kvpush refuses; ``kind`` says why (for counting), ``str()`` says what."""

    def __init__(self, kind: MessageErrorKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind


_ENCODER: Final = msgspec.json.Encoder()
# the messages each subject kind carries (also the AsyncAPI channels' messages, export.py)
CARRIES: Final[dict[SubjectKind, tuple[type[msgspec.Struct], ...]]] = {
    SubjectKind.REQUEST: (RequestEvent,),
    SubjectKind.BLOCKS: (BlocksAnnounced,),
    SubjectKind.KV_READY: (KvReady,),
    SubjectKind.KV_DONE: (KvPushed, KvPushing, FirstToken),
    SubjectKind.KV_FAILED: (KvFailed,),
    SubjectKind.TOKENS: (TokenChunk,),
    SubjectKind.ABORT: (Abort, AbortAck),
    SubjectKind.HEARTBEAT: (WorkerHeartbeat,),
    SubjectKind.CACHE: (CacheEvents,),
    SubjectKind.CACHE_SYNC: (CacheSync,),
}
_DECODERS: Final = {
    kind: msgspec.json.Decoder(Union[carried])  # noqa: UP007
    for kind, carried in CARRIES.items()
}


class _Envelope(msgspec.Struct):
    type: str = ""


_ENVELOPE: Final = msgspec.json.Decoder(_Envelope)


def encode(message: BusMessage) -> bytes:
    """Serialize a message to its JSON wire form."""
    return _ENCODER.encode(message)


def decode(subject: str, payload: bytes | bytearray | memoryview) -> BusMessage:
    """Decode ``payload`` received on ``subject`` or raise ``MessageError``."""
    try:
        parsed = subjects.parse(subject)
    except SubjectError as exc:
        raise MessageError(MessageErrorKind.SUBJECT, str(exc)) from None
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MessageError(
            MessageErrorKind.TOO_LARGE, f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}"
        )
    try:
        message = _DECODERS[parsed.kind].decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, OverflowError) as exc:
        raise _classify(parsed.kind, payload, exc) from None
    _check_ids(parsed, message)
    return message


def _classify(
    kind: SubjectKind, payload: bytes | bytearray | memoryview, exc: Exception
) -> MessageError:
    try:
        tag = _ENVELOPE.decode(payload).type
    except (msgspec.DecodeError, UnicodeDecodeError, OverflowError):
        tag = ""
    if isinstance(tag, str) and tag.startswith("kvpush.v") and not tag.startswith(TAG_PREFIX):
        return MessageError(MessageErrorKind.VERSION, f"unsupported message type {tag[:80]!r}")
    if tag.startswith(TAG_PREFIX) and "Invalid value" in str(exc) and "$.type" in str(exc):
        return MessageError(
            MessageErrorKind.WRONG_TYPE, f"{tag[:80]!r} is not carried on {kind.value}"
        )
    return MessageError(MessageErrorKind.MALFORMED, str(exc)[:300])


def _check_ids(parsed: subjects.ParsedSubject, message: BusMessage) -> None:
    ids = parsed.tokens
    expected: dict[str, str] = {}
    if isinstance(message, RequestEvent):
        expected = {"prefill_id": ids[0], "decode_id": ids[1]}
    elif isinstance(message, (KvPushed, KvPushing, FirstToken, KvFailed)):
        expected = {"decode_id": ids[0]}
    elif isinstance(message, WorkerHeartbeat):
        expected = {"role": ids[0], "worker_id": ids[1]}
    elif isinstance(message, CacheEvents):
        expected = {"worker_id": ids[1]}
    for field, want in expected.items():
        got = getattr(message, field)
        got = getattr(got, "value", got)  # the role: an enum
        if got != want:
            raise MessageError(
                MessageErrorKind.MISMATCH, f"{field}={got!r} but subject says {want!r}"
            )
