"""The gateway's prefix index: which worker's prefix cache holds which prompt prefixes.

Built from the workers' ``CacheEvents`` (``kvpush.v1.cache.<role>.<worker>``: what vLLM's prefix
cache stored and dropped, as chained prefix hashes of ``schemas/prefix.py``), it maps each
prefix hash to the workers holding it, and each worker to its hashes (oldest first).
``matched_tokens`` (``routing.PrefixLookup``, which the router asks) hashes a prompt block by
block, one dict lookup each, and stops at the first block none of the asked workers holds.

Consistency: a worker's messages carry its ``epoch`` and a ``seq`` (from 0 per epoch). A worker
that joins the membership (``joined``: the gateway or the worker starts, the worker restarts or
is heard again) is asked for a snapshot (``CacheSync`` through ``request_sync``). A gap in
``seq``, or a first message that is no snapshot, drops what the index held of that worker and
asks again (at most every ``sync_interval_s`` while none came); a new epoch (a restart) drops
the worker's entries too. What arrives meanwhile is applied (it is true): the index may miss a
hit for a while, it never invents one. A worker that leaves the membership is forgotten
(``forget``). ``cleared`` (the engine dropped everything, or the worker lost its engine's
events) empties the worker's entries, as the first message of a snapshot does.

Bound: at most ``max_blocks`` (worker, prefix hash) entries in all (default 500,000, about 400
bytes each: 200 MB at most), and per worker at most its heartbeat's ``total_blocks``
(``set_capacity``): past either the oldest entry goes (of that worker, or at the global bound
of the worker holding most); at most ``MAX_WORKERS`` workers. Only workers of one block size
are indexed (the first seen); others are counted in ``stats.other_block_size``.

Threading model: not thread-safe; the gateway's asyncio loop calls everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpush.schemas.messages import CacheEvents
from kvpush.schemas.prefix import iter_block_hashes

DEFAULT_MAX_BLOCKS: Final = 500_000  # about 400 bytes each: 200 MB at most
MAX_WORKERS: Final = 4096
SYNC_INTERVAL_S: Final = 1.0  # a worker is asked for a snapshot at most this often


@dataclass
class IndexStats:
    messages: int = 0
    gaps: int = 0  # seq gaps (and first messages that were no snapshot): entries dropped
    restarts: int = 0  # a new epoch of a known worker: entries dropped
    stale: int = 0  # messages of an older epoch, ignored
    evicted: int = 0  # entries dropped at a bound
    sync_requests: int = 0
    other_block_size: int = 0  # messages of workers of another block size, ignored
    too_many_workers: int = 0  # messages of workers past MAX_WORKERS, ignored


@dataclass
class WorkerCache:
    """What the index holds of one worker."""

    epoch: int
    capacity: int
    next_seq: int | None = None  # None: nothing in order seen yet
    hashes: dict[int, None] = field(default_factory=dict)  # insertion order: oldest first
    synced: bool = False  # a snapshot (or clear) came since the last drop
    sync_asked_at: float | None = None


class PrefixIndex:
    """Prefix hash -> workers holding it; see the module docstring."""

    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        request_sync: Callable[[list[str]], None] = lambda workers: None,
        *,
        sync_interval_s: float = SYNC_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, not {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size = 0
        self.stats = IndexStats()
        self._request_sync = request_sync
        self._sync_interval_s = sync_interval_s
        self._clock = clock
        self._holders: dict[int, set[str]] = {}
        self._workers: dict[str, WorkerCache] = {}
        self._capacity: dict[str, int] = {}  # from heartbeats, kept while the worker is known
        self._entries = 0

    def __len__(self) -> int:
        """(worker, prefix hash) entries held."""
        return self._entries

    def blocks_of(self, worker_id: str) -> int:
        cache = self._workers.get(worker_id)
        return len(cache.hashes) if cache is not None else 0

    # ---- lookups ------------------------------------------------------------------------------
    def matched_tokens(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Leading tokens of ``token_ids`` (whole blocks) each of ``workers`` holds, by worker
        id; workers holding none are left out. One hash and one dict lookup per block, up to
        the first block none of them holds."""
        block_size = self.block_size
        wanted = {w for w in workers if w in self._workers}
        if not block_size or not wanted:
            return {}
        matched: dict[str, int] = {}
        blocks = 0
        holders_of = self._holders.get
        for prefix_hash in iter_block_hashes(token_ids, block_size):
            holders = holders_of(prefix_hash)
            if holders is None:
                break
            if not wanted <= holders:
                still = wanted & holders
                if blocks:
                    for worker in wanted - still:
                        matched[worker] = blocks * block_size
                wanted = still
                if not wanted:
                    break
            blocks += 1
        if blocks:
            for worker in wanted:
                matched[worker] = blocks * block_size
        return matched

    # ---- membership ---------------------------------------------------------------------------
    def set_capacity(self, worker_id: str, total_blocks: int) -> None:
        """The worker's pool size (its heartbeat's ``total_blocks``): it never holds more."""
        if total_blocks <= 0:
            return
        self._capacity[worker_id] = total_blocks
        cache = self._workers.get(worker_id)
        if cache is not None:
            cache.capacity = min(total_blocks, self.max_blocks)
            while len(cache.hashes) > cache.capacity:
                self._evict_oldest(worker_id, cache)

    def joined(self, worker_id: str, epoch: int, total_blocks: int) -> None:
        """A worker joined the membership (a new one, a restart, or one heard again): its pool
        size bounds it, and it is asked for a snapshot unless one of this epoch came."""
        self.set_capacity(worker_id, total_blocks)
        cache = self._cache_of(worker_id, epoch)
        if cache is not None and not cache.synced:
            self._ask_sync(worker_id, cache)

    def forget(self, worker_id: str) -> None:
        """The worker left the membership: drop everything of it."""
        cache = self._workers.pop(worker_id, None)
        self._capacity.pop(worker_id, None)
        if cache is not None:
            self._drop(worker_id, cache)

    # ---- events -------------------------------------------------------------------------------
    async def on_message(self, subject: str, message: object) -> None:
        """Bus handler for ``kvpush.v1.cache.*.*``."""
        if isinstance(message, CacheEvents):
            self.apply(message)

    def apply(self, message: CacheEvents) -> None:
        self.stats.messages += 1
        worker_id = message.worker_id
        if message.block_size and message.block_size != self.block_size:
            if self.block_size:
                self.stats.other_block_size += 1
                return
            self.block_size = message.block_size
        cache = self._cache_of(worker_id, message.epoch)
        if cache is None:
            return
        first = cache.next_seq is None
        in_order = not first and message.seq == cache.next_seq
        cache.next_seq = message.seq + 1
        if message.cleared:
            self._drop(worker_id, cache)
            cache.synced = True  # a snapshot starts, or the worker's cache is empty now
        elif not in_order:  # history missed: what we hold of it may be wrong
            self.stats.gaps += 0 if first else 1
            self._drop(worker_id, cache)
            cache.synced = False
        for prefix_hash in message.removed:
            self._remove(worker_id, cache, prefix_hash)
        for prefix_hash in message.stored:
            self._store(worker_id, cache, prefix_hash)
        if not cache.synced:
            self._ask_sync(worker_id, cache)

    def _cache_of(self, worker_id: str, epoch: int) -> WorkerCache | None:
        cache = self._workers.get(worker_id)
        if cache is not None and epoch < cache.epoch:
            self.stats.stale += 1
            return None
        if cache is not None and epoch == cache.epoch:
            return cache
        if cache is not None:  # a restart: what the old incarnation held is gone
            self.stats.restarts += 1
            self._drop(worker_id, cache)
        elif len(self._workers) >= MAX_WORKERS:
            self.stats.too_many_workers += 1
            return None
        capacity = min(self._capacity.get(worker_id, self.max_blocks), self.max_blocks)
        cache = WorkerCache(epoch=epoch, capacity=capacity)
        self._workers[worker_id] = cache
        return cache

    def _ask_sync(self, worker_id: str, cache: WorkerCache) -> None:
        now = self._clock()
        if cache.sync_asked_at is not None and now - cache.sync_asked_at < self._sync_interval_s:
            return
        cache.sync_asked_at = now
        self.stats.sync_requests += 1
        self._request_sync([worker_id])

    def _store(self, worker_id: str, cache: WorkerCache, prefix_hash: int) -> None:
        if prefix_hash in cache.hashes:  # refreshed: now the newest
            del cache.hashes[prefix_hash]
            cache.hashes[prefix_hash] = None
            return
        if len(cache.hashes) >= cache.capacity:
            self._evict_oldest(worker_id, cache)
        if self._entries >= self.max_blocks:
            fullest = max(self._workers, key=lambda w: len(self._workers[w].hashes))
            self._evict_oldest(fullest, self._workers[fullest])
        cache.hashes[prefix_hash] = None
        holders = self._holders.get(prefix_hash)
        if holders is None:
            self._holders[prefix_hash] = {worker_id}
        else:
            holders.add(worker_id)
        self._entries += 1

    def _remove(self, worker_id: str, cache: WorkerCache, prefix_hash: int) -> None:
        if prefix_hash not in cache.hashes:
            return
        del cache.hashes[prefix_hash]
        self._entries -= 1
        holders = self._holders.get(prefix_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[prefix_hash]

    def _evict_oldest(self, worker_id: str, cache: WorkerCache) -> None:
        if cache.hashes:
            self.stats.evicted += 1
            self._remove(worker_id, cache, next(iter(cache.hashes)))

    def _drop(self, worker_id: str, cache: WorkerCache) -> None:
        for prefix_hash in cache.hashes:
            holders = self._holders.get(prefix_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[prefix_hash]
        self._entries -= len(cache.hashes)
        cache.hashes.clear()
