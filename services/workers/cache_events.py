"""What the engine's prefix cache holds: vLLM's own KV cache events, read and mirrored.

vLLM's scheduler publishes every block its prefix cache stores or drops (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) on a ZMQ PUB socket (``engine_config.kv_events_config``: an
ipc:// file socket private to this worker, ``events_socket.events_endpoint``; the engine binds it,
in this process or in its engine-core process, one publisher whatever the TP; a clean stop removes
the file, and the next start of a worker killed with ``kill -9`` removes the one it left:
``remove_stale_sockets``). ``CacheEventReader`` reads it and keeps ``CacheMirror``: vLLM's block
hash (salted per engine) -> our chained prefix hash (``schemas/prefix.py``, the one the gateway
computes), bounded by the pool's block count (past it the least recently stored or reused entry is
dropped and reported removed; of one event's blocks the first is the most recent, so a chain loses
its tail before its head). Changes collect in ``PendingChanges`` (per hash its net change since the
last publish, a ``cleared`` flag, bounded: past the mirror's capacity it becomes a snapshot), which
``cache_publisher.CachePublisher`` takes on the worker's loop and publishes as ``CacheEvents``.

Not indexed, and counted in ``CacheMirror.skipped`` by why: blocks whose hash has extra keys
(LoRA, multimodal inputs, a cache_salt, prompt embeddings), another medium than the engine's
own pool (``GPU``: vLLM 0.26 and 0.32 report it so on every device, the CPU too; ``CPU`` is an
offload tier), a KV cache group other than the first, another block size than the first seen,
and a block whose parent the mirror does not know (its chain cannot be computed). vLLM reports
a prefix-cache hit only for requests in its "full" report mode
(``extra_args["kv_cache_report_mode"]``, which the worker sets with ``--kv-events on``:
``fanout.engine_params``), as a ``BlockStored`` of the whole hit from the first block (no
parent): a block already held is refreshed in the LRU order and publishes nothing, one the
mirror lost (a clear) is indexed again, so a prefix the engine still holds comes back with the
next request that reuses it and the blocks that extend it are no orphans. A hash held by two
blocks at once is dropped at the first one's removal (the index may then miss a hit, never
claim a false one). A gap in vLLM's sequence numbers (its socket dropped messages), a batch that
does not decode or fails to apply, and a reader thread that ends on an error clear the mirror:
reported ``cleared`` (a dead reader reports nothing after it).

Threading model: ``CacheEventReader`` runs its ZMQ socket on its own daemon thread
(``kvpush-kv-events``); the mirror and pending changes are shared with the worker's loop under
one lock; ``on_ready`` is called from the reader thread (the caller makes it thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec
import zmq

from kvpush.schemas.prefix import ROOT, block_hashes

log = logging.getLogger(__name__)

POOL_MEDIA = frozenset({None, "GPU"})  # the engine's own pool, on any device ("CPU": offload)
POLL_MS = 100  # the reader thread looks at its stop flag this often
EngineHash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True):
    """vLLM's event (a map on the wire, so fields added by later versions are ignored)."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


EngineEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007


class EventBatch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch`` (an array on the wire); events decode one by one."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass
class PendingChanges:
    """Changes not yet published: each prefix hash's net change since the last take (True:
    stored, False: removed; a hash stored and removed again before it was published leaves no
    entry), and whether the cache was cleared first. Past ``limit`` entries (0: none) it keeps
    none and is ``overflowed``: the publisher sends a snapshot instead (the mirror holds at most
    its capacity, the limit)."""

    limit: int = 0
    held: dict[int, bool] = field(default_factory=dict)
    cleared: bool = False
    overflowed: bool = False
    # first stored in this round: unknown to gateways (unless held by a second block)
    _fresh: set[int] = field(default_factory=set, repr=False)

    def store(self, prefix_hash: int) -> None:
        if self.overflowed:
            return
        if prefix_hash not in self.held:
            self._fresh.add(prefix_hash)
        self.held[prefix_hash] = True
        self._bound()

    def remove(self, prefix_hash: int) -> None:
        if self.overflowed:
            return
        if prefix_hash in self._fresh:  # never published: nothing to say
            self._fresh.discard(prefix_hash)
            del self.held[prefix_hash]
        elif not self.cleared:  # after a clear, gateways hold nothing of before it
            self.held[prefix_hash] = False
            self._bound()

    def clear(self) -> None:
        self.held.clear()
        self._fresh.clear()
        self.cleared = True

    def __bool__(self) -> bool:
        return self.cleared or self.overflowed or bool(self.held)

    def split(self) -> tuple[list[int], list[int]]:
        """(stored, removed) prefix hashes."""
        stored = [h for h, held in self.held.items() if held]
        return stored, [h for h, held in self.held.items() if not held]

    def _bound(self) -> None:
        if self.limit and len(self.held) > self.limit:
            self.held.clear()
            self._fresh.clear()
            self.overflowed = True


class CacheMirror:
    """vLLM block hash -> our prefix hash of what the engine holds; see the module docstring.
    Not thread-safe: the reader holds its lock around every call."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.block_size = 0  # of the first indexed block; 0 while none was
        self.skipped: Counter[str] = Counter()
        self._held: OrderedDict[EngineHash, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._held)

    def prefix_hashes(self) -> list[int]:
        return list(self._held.values())

    def apply(self, event: EngineEvent, changes: PendingChanges) -> None:
        if isinstance(event, AllBlocksCleared):
            self.clear(changes)
        elif isinstance(event, BlockRemoved):
            if event.medium not in POOL_MEDIA or event.group_idx not in (None, 0):
                return  # never indexed (BlockStored counted it)
            for engine_hash in event.block_hashes:
                prefix_hash = self._held.pop(engine_hash, None)
                if prefix_hash is not None:
                    changes.remove(prefix_hash)
        else:
            self._store(event, changes)

    def clear(self, changes: PendingChanges) -> None:
        self._held.clear()
        changes.clear()

    def _store(self, event: BlockStored, changes: PendingChanges) -> None:
        why = self._unindexed(event)
        if why:
            self.skipped[why] += len(event.block_hashes)
            return
        parent = ROOT
        if event.parent_block_hash is not None:
            known = self._held.get(event.parent_block_hash)
            if known is None:
                self.skipped["orphan"] += len(event.block_hashes)
                return
            parent = known
        # a hit (vLLM's "full" report) repeats blocks already held: hash only from the first
        # block not held, chained on the one before it (already published)
        held, engine_hashes = self._held, event.block_hashes
        first = next((i for i, h in enumerate(engine_hashes) if h not in held), len(engine_hashes))
        if first:
            parent = held[engine_hashes[first - 1]]
        ours = block_hashes(event.token_ids[first * event.block_size :], event.block_size, parent)
        for engine_hash, prefix_hash in zip(engine_hashes[first:], ours, strict=True):
            if engine_hash in held:  # reused: refreshed below, already published
                continue
            if len(held) >= self.capacity:  # room first: the least recently used goes
                changes.remove(self._held.popitem(last=False)[1])
            self._held[engine_hash] = prefix_hash
            changes.store(prefix_hash)
        for engine_hash in reversed(event.block_hashes):  # most recent: the chain's head, as a
            if engine_hash in self._held:  # prefix is of no use without it
                self._held.move_to_end(engine_hash)

    def _unindexed(self, event: BlockStored) -> str:
        """Why a stored event is not indexed ("": it is)."""
        if event.lora_id is not None or event.lora_name is not None:
            return "lora"
        if event.extra_keys and any(keys for keys in event.extra_keys):
            return "extra_keys"
        if event.medium not in POOL_MEDIA:
            return "medium"
        if event.group_idx not in (None, 0):
            return "group"
        if event.block_size <= 0 or len(event.token_ids) != event.block_size * len(
            event.block_hashes
        ):
            return "shape"
        if self.block_size and event.block_size != self.block_size:
            return "block_size"
        self.block_size = event.block_size
        return ""


class CacheEventReader:
    """Reads vLLM's KV event socket on its own thread into a ``CacheMirror``."""

    def __init__(
        self, endpoint: str, capacity: int, on_ready: Callable[[], None] = lambda: None
    ) -> None:
        self.endpoint = endpoint
        self.mirror = CacheMirror(capacity)
        self.gaps = 0  # sequence gaps, batches that failed to decode or apply: each a clear
        self.failed = False  # the thread ended on an error: nothing more is read
        self.on_ready = on_ready  # called from the reader thread
        self._lock = threading.Lock()
        self._changes = self._no_changes()
        self._last_seq: int | None = None
        self._stopping = threading.Event()
        self._batch = msgspec.msgpack.Decoder(EventBatch)
        self._event = msgspec.msgpack.Decoder(EngineEvent)
        self._thread = threading.Thread(target=self._run, name="kvpush-kv-events", daemon=True)
        self._socket: zmq.Socket[bytes] | None = None

    def start(self) -> None:
        """Connect (the engine binds; ZMQ connects whenever it does) and start reading; a
        refused endpoint raises ``zmq.ZMQError`` and leaves nothing open."""
        sock = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self._socket = sock
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if self.endpoint.startswith("ipc://"):  # the engine's socket file, left behind
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint.removeprefix("ipc://"))

    def take(self) -> PendingChanges:
        """The changes since the last take (or snapshot)."""
        with self._lock:
            changes, self._changes = self._changes, self._no_changes()
        return changes

    def snapshot(self) -> tuple[list[int], int]:
        """(every prefix hash held, block size); pending changes are part of it (dropped)."""
        with self._lock:
            self._changes = self._no_changes()
            return self.mirror.prefix_hashes(), self.mirror.block_size

    def feed(self, seq: int, payload: bytes) -> None:
        """One message of the socket (the thread's work; tests call it directly). A batch that
        fails in any way is a gap: the mirror is cleared, the reader goes on."""
        with self._lock:
            gap = self._last_seq is not None and seq != self._last_seq + 1
            self._last_seq = seq
            try:
                self._apply(seq, payload, gap)
            except Exception:
                log.exception("KV event batch %d failed: clearing the mirror", seq)
                self._clear()
            ready = bool(self._changes)
        if ready:
            self.on_ready()

    def _no_changes(self) -> PendingChanges:
        return PendingChanges(limit=self.mirror.capacity)

    def _clear(self) -> None:
        """Under the lock: a gap."""
        self.gaps += 1
        self.mirror.clear(self._changes)

    def _apply(self, seq: int, payload: bytes, gap: bool) -> None:
        try:
            batch = self._batch.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("undecodable KV event batch %d: %s", seq, exc)
            batch, gap = None, True
        if gap:
            self._clear()
        for raw in batch.events if batch is not None else ():
            try:
                event = self._event.decode(raw)
            except msgspec.DecodeError:
                self.mirror.skipped["unknown_event"] += 1
                continue
            self.mirror.apply(event, self._changes)

    def _run(self) -> None:
        sock = self._socket
        assert sock is not None
        try:
            while not self._stopping.is_set():
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    continue
                self.feed(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except Exception:  # the worker keeps serving; the gateways drop what it reported
            log.exception("KV cache event reader failed: reporting the cache cleared")
        finally:
            sock.close(linger=0)
            if not self._stopping.is_set():
                self._fail()

    def _fail(self) -> None:
        """The thread ends before ``stop``: nothing more will be read, so nothing is claimed."""
        with self._lock:
            self.failed = True
            self._clear()
        with contextlib.suppress(Exception):  # the loop may be closed already
            self.on_ready()
