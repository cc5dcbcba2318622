"""The gateway's prefix index: which worker's prefix cache holds which prompt prefixes.

Built from the workers' ``CacheEvents`` (``kvpush.v1.cache.<role>.<worker>``: what vLLM's prefix
cache stored and dropped, as chained prefix hashes of ``schemas/prefix.py``), it keeps each
worker's hashes in an ``OrderedDict``, least recently stored or matched first.
``matched_tokens`` (``routing.PrefixLookup``, which the router asks) hashes a prompt's blocks
and finds, per asked worker, the leading blocks it holds (a binary search over the prompt's
chain); near the index's bounds the blocks it matched become that worker's newest (LRU), the
chain's first block last, so the leaves of a shared prefix go before its root (as vLLM frees a
request's blocks: last block first; a message's stored hashes are taken in that order too).

Consistency: a worker's messages carry its ``epoch`` and a ``seq`` (from 0 per epoch). A worker
that joins the membership (``joined``: the gateway or the worker starts, the worker restarts or
is heard again) is asked for a snapshot (``CacheSync`` through ``request_sync``). A gap in
``seq``, or a first message that is no snapshot, drops what the index held of that worker and
asks again (at most every ``sync_interval_s`` while none came); a new epoch (a restart) drops
the worker's entries too. What arrives meanwhile is applied (it is true): the index may miss a
hit for a while, it never invents one. ``cleared`` (the engine dropped everything, or the worker
lost its engine's events) empties the worker's entries, as the first message of a snapshot does.
A worker that leaves the membership is forgotten (``forget(worker_id, epoch)``) unless a newer
epoch of it already reports; messages of that epoch or older are ignored after it, until the
worker joins again; its pool size is kept for a later incarnation.

Cost: ``forget`` and every drop are O(1): the dropped hashes wait in a queue (``pending_drop``)
and are freed ``DRAIN_CHUNK`` at a time at the end of each ``apply`` (or one at a time when a
store needs room), never inside a routing decision. An eviction removes one entry without
scanning workers or entries: ``popitem(last=False)`` of the worker being stored to once it
holds its fair share (``max_blocks`` / workers) or more, else of a worker that holds its share
(taking turns; a set kept up to date on every store and removal, rebuilt only when the number
of workers changed).

Bound: at most ``max_blocks`` (worker, prefix hash) entries in all, those waiting to be freed
included (default 500,000, ``--prefix-index-max-blocks``; about 140 bytes each: 70 MB at most),
and per worker at most its heartbeat's ``total_blocks`` (``set_capacity``); at most
``MAX_WORKERS`` workers. Only workers of one block size are indexed (the first seen); others
are counted in ``stats.other_block_size``.

Threading model: not thread-safe; the gateway's asyncio loop calls everything.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpush.schemas.messages import CacheEvents
from kvpush.schemas.prefix import PromptHasher

DEFAULT_MAX_BLOCKS: Final = 500_000  # about 140 bytes each: 70 MB at most
MAX_WORKERS: Final = 4096
SYNC_INTERVAL_S: Final = 1.0  # a worker is asked for a snapshot at most this often
DRAIN_CHUNK: Final = 4096  # dropped entries freed per apply
TOUCH_FROM: Final = 0.9  # share of max_blocks from which a match makes its blocks the newest

Hashes = OrderedDict[int, None]  # least recently stored or matched first


@dataclass
class IndexStats:
    messages: int = 0
    gaps: int = 0  # seq gaps (and first messages that were no snapshot): entries dropped
    restarts: int = 0  # a new epoch of a known worker: entries dropped
    stale: int = 0  # messages of an older (or a departed) epoch, ignored
    evicted: int = 0  # entries dropped at a bound
    sync_requests: int = 0
    other_block_size: int = 0  # messages of workers of another block size, ignored
    too_many_workers: int = 0  # messages of workers past MAX_WORKERS, ignored
    share_rebuilds: int = 0  # the set of workers holding their fair share, rebuilt


@dataclass
class WorkerCache:
    """What the index holds of one worker."""

    epoch: int
    capacity: int
    next_seq: int | None = None  # None: nothing in order seen yet
    hashes: Hashes = field(default_factory=OrderedDict)
    synced: bool = False  # a snapshot (or clear) came since the last drop
    sync_asked_at: float | None = None


class PrefixIndex:
    """Each worker's prefix hashes, bounded; see the module docstring."""

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
        self._workers: dict[str, WorkerCache] = {}
        self._entries = 0  # in the workers' caches
        # pool sizes from heartbeats, kept after a worker leaves (its next incarnation's bound)
        self._capacity: OrderedDict[str, int] = OrderedDict()
        self._departed: OrderedDict[str, int] = OrderedDict()  # worker -> the epoch that left
        self._dropped: deque[Hashes] = deque()  # dropped entries, freed a chunk at a time
        self._dropped_entries = 0
        self._fair_share = 0  # what _at_share was built for
        self._at_share: OrderedDict[str, None] = OrderedDict()  # workers holding >= it
        self._hasher: PromptHasher | None = None  # for block_size, made on the first look-up

    def __len__(self) -> int:
        """(worker, prefix hash) entries held."""
        return self._entries

    @property
    def pending_drop(self) -> int:
        """Entries dropped (a worker left, restarted, cleared) and not yet freed."""
        return self._dropped_entries

    def blocks_of(self, worker_id: str) -> int:
        cache = self._workers.get(worker_id)
        return len(cache.hashes) if cache is not None else 0

    # ---- lookups ------------------------------------------------------------------------------
    def matched_tokens(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Leading tokens of ``token_ids`` (whole blocks) each of ``workers`` holds, by worker
        id; workers holding none are left out. The first block is hashed alone (a prompt no
        worker holds costs one block's hash); for the workers holding it, the prompt's whole
        chain at once (both by a ``schemas.prefix.PromptHasher`` of the index's block size), and
        each one's depth is found by a binary search over the chain: O(log blocks) look-ups, not
        one per block. That reads a worker's chain as held from its root up to some block, as
        vLLM keeps it (it frees a request's blocks last first, so a chain loses its tail first);
        a hole in a chain (the index's own eviction, or an unusual eviction in the engine) can
        make the count stop before it or run past it. Routing reads this as an estimate: the
        engine checks its own hashes before it reuses a block. Near the index's bounds
        (``touches``) the matched blocks become the worker's newest, the chain's root last."""
        block_size = self.block_size
        if not block_size or len(token_ids) < block_size:
            return {}
        hasher = self._hasher
        if hasher is None or hasher.block_size != block_size:
            hasher = self._hasher = PromptHasher(block_size)
        first = hasher.first(token_ids)  # faster than numpy's for one block
        caches = self._workers
        wanted = [(w, c) for w in workers if (c := caches.get(w)) is not None and first in c.hashes]
        if not wanted:
            return {}
        chain = hasher.chain(token_ids)
        hash_at, blocks = memoryview(chain), len(chain)  # hash_at[i]: block i's, a Python int
        matched: dict[str, int] = {}
        for worker, cache in wanted:
            hashes = cache.hashes
            held, missing = 1, blocks + 1  # chain[:held] is held; chain[missing - 1] is not
            while missing - held > 1:
                middle = (held + missing) // 2
                if hash_at[middle - 1] in hashes:
                    held = middle
                else:
                    missing = middle
            matched[worker] = held * block_size
            if self.touches(cache):
                leaves = chain[1:held].tolist()
                deque(map(hashes.move_to_end, reversed(leaves)), maxlen=0)  # leaves first ...
                hashes.move_to_end(first)  # ... the root newest: the last of the chain to go
        return matched

    def touches(self, cache: WorkerCache) -> bool:
        """Whether a match reorders the worker's entries: only near a bound, where the index
        evicts its least recently stored or matched entries (``TOUCH_FROM`` of ``max_blocks``
        in all, or the worker at its own bound); below them the order decides nothing."""
        if len(cache.hashes) >= cache.capacity:
            return True
        return self._entries + self._dropped_entries >= self.max_blocks * TOUCH_FROM

    # ---- membership ---------------------------------------------------------------------------
    def set_capacity(self, worker_id: str, total_blocks: int) -> None:
        """The worker's pool size (its heartbeat's ``total_blocks``): it never holds more."""
        if total_blocks <= 0:
            return
        self._capacity[worker_id] = total_blocks
        self._capacity.move_to_end(worker_id)
        if len(self._capacity) > 2 * MAX_WORKERS:
            self._capacity.popitem(last=False)
        cache = self._workers.get(worker_id)
        if cache is not None:
            cache.capacity = min(total_blocks, self.max_blocks)
            while len(cache.hashes) > cache.capacity:
                self._evict_oldest(worker_id, cache)

    def joined(self, worker_id: str, epoch: int, total_blocks: int) -> None:
        """A worker joined the membership (a new one, a restart, or one heard again): its pool
        size bounds it, and it is asked for a snapshot unless one of this epoch came."""
        if self._departed.get(worker_id, epoch) > epoch:
            return  # an older incarnation than one that already left
        self._departed.pop(worker_id, None)
        self.set_capacity(worker_id, total_blocks)
        cache = self._cache_of(worker_id, epoch)
        if cache is not None and not cache.synced:
            self._ask_sync(worker_id, cache)

    def forget(self, worker_id: str, epoch: int) -> None:
        """Incarnation ``epoch`` of the worker left the membership: drop what the index holds of
        it (unless a newer epoch reports already) and ignore its late messages. O(1): the
        entries are freed later (``pending_drop``)."""
        cache = self._workers.get(worker_id)
        if cache is not None and cache.epoch > epoch:
            return  # the restarted worker's snapshot came before the old incarnation's leave
        self._departed[worker_id] = max(epoch, self._departed.get(worker_id, epoch))
        self._departed.move_to_end(worker_id)
        if len(self._departed) > MAX_WORKERS:
            self._departed.popitem(last=False)
        if cache is not None:
            self._drop(worker_id, cache)
            del self._workers[worker_id]

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
        if cache is not None:
            self._apply(worker_id, cache, message)
        self.drain(DRAIN_CHUNK)

    def drain(self, limit: int) -> None:
        """Free up to ``limit`` dropped entries."""
        while limit > 0 and self._dropped:
            hashes = self._dropped[0]
            if len(hashes) <= limit:  # freed at once (C-speed, at most ``limit`` entries)
                freed = len(hashes)
                self._dropped.popleft()
            else:
                freed = limit
                for _ in range(limit):
                    hashes.popitem()
            self._dropped_entries -= freed
            limit -= freed

    def _apply(self, worker_id: str, cache: WorkerCache, message: CacheEvents) -> None:
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
        for prefix_hash in reversed(message.stored):  # a chain's last block is the oldest
            self._store(worker_id, cache, prefix_hash)
        if not cache.synced:
            self._ask_sync(worker_id, cache)

    def _cache_of(self, worker_id: str, epoch: int) -> WorkerCache | None:
        cache = self._workers.get(worker_id)
        if cache is None and epoch <= self._departed.get(worker_id, epoch - 1):
            self.stats.stale += 1  # a late message of an incarnation that left
            return None
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
        self._departed.pop(worker_id, None)
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

    # ---- entries ------------------------------------------------------------------------------
    def _store(self, worker_id: str, cache: WorkerCache, prefix_hash: int) -> None:
        hashes = cache.hashes
        if prefix_hash in hashes:  # refreshed: now the newest
            hashes.move_to_end(prefix_hash)
            return
        if len(hashes) >= cache.capacity:
            self._evict_oldest(worker_id, cache)
        if self._entries + self._dropped_entries >= self.max_blocks:
            self._make_room(worker_id, cache)
        hashes[prefix_hash] = None
        self._entries += 1
        if len(hashes) == self._fair_share:
            self._at_share[worker_id] = None

    def _remove(self, worker_id: str, cache: WorkerCache, prefix_hash: int) -> None:
        if cache.hashes.pop(prefix_hash, False) is None:
            self._removed_one(worker_id, cache)

    def _evict_oldest(self, worker_id: str, cache: WorkerCache) -> None:
        if cache.hashes:
            self.stats.evicted += 1
            cache.hashes.popitem(last=False)
            self._removed_one(worker_id, cache)

    def _removed_one(self, worker_id: str, cache: WorkerCache) -> None:
        self._entries -= 1
        if len(cache.hashes) == self._fair_share - 1:
            self._at_share.pop(worker_id, None)

    def _make_room(self, worker_id: str, cache: WorkerCache) -> None:
        """At the global bound: free one dropped entry, else evict the oldest entry of this
        worker if it holds its fair share, else of one that does. O(1)."""
        if self._dropped:
            self._dropped[0].popitem()
            self._dropped_entries -= 1
            if not self._dropped[0]:
                self._dropped.popleft()
            return
        fair_share = max(1, self.max_blocks // len(self._workers))
        if fair_share != self._fair_share:
            self._share_changed(fair_share)
        if len(cache.hashes) < fair_share and self._at_share:
            # some other worker holds its share: the entries are >= max_blocks, this one less
            worker_id = next(iter(self._at_share))
            self._at_share.move_to_end(worker_id)  # the next eviction takes another's turn
            cache = self._workers[worker_id]
        self._evict_oldest(worker_id, cache)

    def _share_changed(self, fair_share: int) -> None:
        """The number of workers changed: who holds its fair share, anew (O(workers))."""
        self.stats.share_rebuilds += 1
        self._fair_share = fair_share
        self._at_share = OrderedDict(
            (w, None) for w, c in self._workers.items() if len(c.hashes) >= fair_share
        )

    def _drop(self, worker_id: str, cache: WorkerCache) -> None:
        """Everything of the worker goes: O(1), the entries are freed later (``drain``)."""
        if cache.hashes:
            self._entries -= len(cache.hashes)
            self._dropped_entries += len(cache.hashes)
            self._dropped.append(cache.hashes)
            cache.hashes = OrderedDict()
        self._at_share.pop(worker_id, None)
