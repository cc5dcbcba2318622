"""NATS subject names of the v1 contract (docs/bus.md): builders, filters and the parser.

Every subject starts with ``kvpush.v1.``; worker and gateway ids are single subject tokens
(``[A-Za-z0-9_-]{1,64}``), checked here so a bad id can never widen a subscription.

Threading model: none (pure functions).
"""

from __future__ import annotations

import enum
import re
from typing import Final, NamedTuple

from kvpush.schemas.messages import PROTOCOL_VERSION, WorkerRole

ROOT: Final = f"kvpush.v{PROTOCOL_VERSION}"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SubjectKind(str, enum.Enum):
    """Which message family a subject carries (the second-level name)."""

    REQUEST = "req"
    BLOCKS = "blocks"
    KV_READY = "kv.ready"
    KV_DONE = "kv.done"
    KV_FAILED = "kv.failed"
    TOKENS = "tokens"
    ABORT = "abort"
    HEARTBEAT = "heartbeat"
    CACHE = "cache"  # a worker's prefix-cache events (CacheEvents)
    CACHE_SYNC = "cache.sync"  # a gateway asks workers for snapshots of their caches (CacheSync)


# id tokens after the kind (1 unless listed), and the kinds whose first token is a role
_ARITY: Final = {
    SubjectKind.REQUEST: 2,
    SubjectKind.HEARTBEAT: 2,
    SubjectKind.CACHE: 2,
    SubjectKind.CACHE_SYNC: 0,
}
_ROLE_FIRST: Final = frozenset({SubjectKind.HEARTBEAT, SubjectKind.CACHE})


class ParsedSubject(NamedTuple):
    kind: SubjectKind
    tokens: tuple[str, ...]  # the id tokens after the kind, e.g. (prefill, decode)


class SubjectError(ValueError):
    """A subject or id that is not part of the kvpush v1 contract."""


def check_id(value: str) -> str:
    """Return ``value`` if it is a valid worker/gateway id (one subject token), else raise."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise SubjectError(f"invalid id {value!r}: use 1-64 characters of [A-Za-z0-9_-]")
    return value


def request(prefill: str, decode: str) -> str:
    return f"{ROOT}.req.{check_id(prefill)}.{check_id(decode)}"


def requests_for_prefill(prefill: str) -> str:
    """Filter a prefill worker subscribes to: every request routed to it, any decode peer."""
    return f"{ROOT}.req.{check_id(prefill)}.*"


def requests_for_decode(decode: str) -> str:
    """Filter a decode worker subscribes to: every request routed to it, any prefill peer."""
    return f"{ROOT}.req.*.{check_id(decode)}"


def blocks(prefill: str) -> str:
    return f"{ROOT}.blocks.{check_id(prefill)}"


def kv_ready(decode: str) -> str:
    return f"{ROOT}.kv.ready.{check_id(decode)}"


def kv_done(decode: str) -> str:
    return f"{ROOT}.kv.done.{check_id(decode)}"


def kv_failed(decode: str) -> str:
    return f"{ROOT}.kv.failed.{check_id(decode)}"


def kv_events(decode: str = "*") -> str:
    """Filter for every kv.* event of one decode worker (or all with the default)."""
    token = decode if decode == "*" else check_id(decode)
    return f"{ROOT}.kv.*.{token}"


def tokens(gateway: str) -> str:
    return f"{ROOT}.tokens.{check_id(gateway)}"


def abort(worker: str) -> str:
    return f"{ROOT}.abort.{check_id(worker)}"


def heartbeat(role: WorkerRole, worker: str) -> str:
    return f"{ROOT}.heartbeat.{WorkerRole(role).value}.{check_id(worker)}"


def heartbeats(role: WorkerRole | None = None) -> str:
    """Filter for heartbeats of one role, or of every role."""
    return f"{ROOT}.heartbeat.{WorkerRole(role).value if role else '*'}.*"


def cache_events(role: WorkerRole, worker: str) -> str:
    """Where a worker publishes what its prefix cache stored and dropped (CacheEvents)."""
    return f"{ROOT}.cache.{WorkerRole(role).value}.{check_id(worker)}"


def cache_events_all() -> str:
    """Filter for the cache events of every worker (not ``cache.sync``: one token fewer)."""
    return f"{ROOT}.cache.*.*"


def cache_sync() -> str:
    """Where a gateway asks workers for snapshots of their prefix caches (CacheSync)."""
    return f"{ROOT}.cache.sync"


def parse(subject: str) -> ParsedSubject:
    """Split a concrete v1 subject into its kind and id tokens; raise SubjectError otherwise."""
    parts = subject.split(".")
    if len(parts) < 3 or f"{parts[0]}.{parts[1]}" != ROOT:
        raise SubjectError(f"not a {ROOT} subject: {subject[:120]!r}")
    rest = parts[2:]
    if rest[0] == "kv" and len(rest) >= 2:
        name, ids = f"kv.{rest[1]}", rest[2:]
    elif rest[:2] == ["cache", "sync"]:
        name, ids = SubjectKind.CACHE_SYNC.value, rest[2:]
    else:
        name, ids = rest[0], rest[1:]
    try:
        kind = SubjectKind(name)
    except ValueError:
        raise SubjectError(f"unknown subject kind {name!r} in {subject[:120]!r}") from None
    arity = _ARITY.get(kind, 1)
    if len(ids) != arity:
        raise SubjectError(f"subject {subject[:120]!r} needs {arity} id token(s)")
    if kind in _ROLE_FIRST and ids[0] not in {role.value for role in WorkerRole}:
        raise SubjectError(f"unknown role {ids[0]!r} in {subject[:120]!r}")
    for token in ids:
        check_id(token)
    return ParsedSubject(kind, tuple(ids))
