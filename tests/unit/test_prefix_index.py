"""The gateway's prefix index: built from CacheEvents, bounded, consistent across gaps,
restarts and workers leaving; ``matched_tokens`` is what the router asks."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.schemas.messages import CacheEvents
from kvpush.schemas.prefix import block_hashes
from kvpush.services.gateway.prefix_index import MAX_WORKERS, PrefixIndex

BS = 4
PROMPT = list(range(1, 17))  # four blocks
OURS = block_hashes(PROMPT, BS)
OTHER = block_hashes([9, 9, 9, 9, 8, 8, 8, 8], BS)


def events(worker: str, seq: int, epoch: int = 1, **fields: Any) -> CacheEvents:
    return CacheEvents(worker_id=worker, epoch=epoch, seq=seq, block_size=BS, **fields)


class Index:
    """A PrefixIndex with its sync requests recorded and a hand-driven clock."""

    def __init__(self, **kwargs: Any) -> None:
        self.asked: list[list[str]] = []
        self.now = 0.0
        self.index = PrefixIndex(request_sync=self.asked.append, clock=lambda: self.now, **kwargs)

    def snapshot(self, worker: str, hashes: list[int], seq: int = 0, epoch: int = 1) -> None:
        self.index.apply(events(worker, seq, epoch, stored=hashes, cleared=True, snapshot=True))

    def match(
        self, prompt: list[int] = PROMPT, workers: tuple[str, ...] = ("d0", "d1")
    ) -> dict[str, int]:
        return self.index.matched_tokens(prompt, workers)


def test_stored_blocks_match_whole_leading_blocks_per_worker() -> None:
    t = Index()
    t.snapshot("d0", OURS[:3])
    t.snapshot("d1", OURS[:1])
    assert t.index.block_size == BS
    assert t.match() == {"d0": 12, "d1": 4}
    assert t.match(PROMPT[:7]) == {"d0": 4, "d1": 4}  # whole blocks of the prompt only
    assert t.match([9, 9, 9, 9, *PROMPT]) == {}  # another prefix: no block of it is held
    assert t.match(workers=("d1",)) == {"d1": 4}  # only the workers asked about
    assert t.match(workers=("d9",)) == {}
    assert t.asked == []  # every worker's history is known: no sync


def test_a_hole_in_the_chain_ends_the_match() -> None:
    t = Index()
    t.snapshot("d0", [OURS[0], OURS[2], OURS[3]])
    assert t.match() == {"d0": 4}


def test_removed_and_cleared() -> None:
    t = Index()
    t.snapshot("d0", OURS)
    t.index.apply(events("d0", 1, removed=[OURS[2]]))
    assert t.match() == {"d0": 8}
    t.index.apply(events("d0", 2, stored=OURS[2:3], removed=[OURS[0]]))
    assert t.match() == {}
    assert t.index.blocks_of("d0") == 3
    t.index.apply(events("d0", 3, cleared=True, stored=OTHER))
    assert t.index.blocks_of("d0") == 2
    assert len(t.index) == 2
    assert t.match([9, 9, 9, 9, 8, 8, 8, 8]) == {"d0": 8}


def test_a_sequence_gap_drops_the_worker_and_asks_for_a_snapshot() -> None:
    t = Index()
    t.snapshot("d0", OURS)
    t.snapshot("d1", OURS)
    t.index.apply(events("d0", 3, stored=OTHER[:1]))  # seq 1 and 2 were lost
    assert t.index.stats.gaps == 1
    assert t.asked == [["d0"]]
    assert t.match() == {"d1": 16}  # d1 untouched; d0 keeps only what came after the gap
    assert t.index.blocks_of("d0") == 1
    t.index.apply(events("d0", 4, stored=OTHER[1:]))  # still unsynced: asked again later only
    assert t.asked == [["d0"]]
    t.now += 1.0
    t.index.apply(events("d0", 5))
    assert t.asked == [["d0"], ["d0"]]
    t.snapshot("d0", OURS[:2], seq=6)  # the snapshot: whole again, nothing more asked
    t.now += 5.0
    t.index.apply(events("d0", 7))
    assert t.asked == [["d0"], ["d0"]]
    assert t.match() == {"d0": 8, "d1": 16}


def test_a_first_message_that_is_no_snapshot_asks_for_one() -> None:
    t = Index()
    t.index.apply(events("d0", 12, stored=OURS[:1]))
    assert t.asked == [["d0"]]
    assert t.index.stats.gaps == 0  # nothing was known: no gap
    assert t.match() == {"d0": 4}  # what it said is true


def test_a_new_epoch_drops_the_old_one_and_late_old_messages_are_ignored() -> None:
    t = Index()
    t.snapshot("d0", OURS)
    t.snapshot("d0", OURS[:1], epoch=2)
    assert t.index.stats.restarts == 1
    assert t.match() == {"d0": 4}
    t.index.apply(events("d0", 1, epoch=1, stored=OURS))
    assert t.index.stats.stale == 1
    assert t.match() == {"d0": 4}


def test_a_worker_that_leaves_is_forgotten() -> None:
    t = Index()
    t.snapshot("d0", OURS)
    t.snapshot("d1", OURS[:2])
    t.index.forget("d0")
    assert t.match() == {"d1": 8}
    assert len(t.index) == 2
    t.index.forget("d1")
    assert len(t.index) == 0
    assert t.match() == {}


def test_per_worker_bound_is_its_pool() -> None:
    t = Index()
    t.index.set_capacity("d0", 2)
    t.snapshot("d0", OURS)  # the oldest go first
    assert t.index.blocks_of("d0") == 2
    assert t.match() == {}  # the first blocks went
    t.snapshot("d1", OURS)
    t.index.set_capacity("d1", 3)  # a smaller pool later: trimmed at once
    assert t.index.blocks_of("d1") == 3
    assert t.index.stats.evicted == 3


def test_the_global_bound_evicts_from_the_fullest_worker() -> None:
    t = Index(max_blocks=5)
    t.snapshot("d0", OURS)
    t.snapshot("d1", OTHER)
    assert len(t.index) == 5
    assert t.index.blocks_of("d0") == 3
    assert t.index.blocks_of("d1") == 2
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)


def test_a_refreshed_block_is_the_newest() -> None:
    t = Index()
    t.index.set_capacity("d0", 2)
    t.snapshot("d0", OURS[:2])
    t.index.apply(events("d0", 1, stored=[OURS[0]]))  # reused: now newest
    t.index.apply(events("d0", 2, stored=[OTHER[0]]))  # evicts OURS[1], not OURS[0]
    assert t.match() == {"d0": 4}


def test_workers_of_another_block_size_are_not_indexed() -> None:
    t = Index()
    t.snapshot("d0", OURS)
    t.index.apply(
        CacheEvents(worker_id="d1", epoch=1, seq=0, block_size=8, stored=[1], cleared=True)
    )
    assert t.index.stats.other_block_size == 1
    assert t.index.blocks_of("d1") == 0


def test_the_number_of_workers_is_bounded() -> None:
    t = Index(max_blocks=MAX_WORKERS + 10)
    for n in range(MAX_WORKERS + 1):
        t.snapshot(f"w{n}", OURS[:1])
    assert t.index.stats.too_many_workers == 1
    assert len(t.index) == MAX_WORKERS


def test_a_worker_that_joins_is_asked_for_a_snapshot_once_per_epoch() -> None:
    t = Index()
    t.index.joined("d0", 1, total_blocks=2)
    assert t.asked == [["d0"]]
    t.snapshot("d0", OURS)
    assert t.index.blocks_of("d0") == 2  # its pool's size, from the heartbeat
    t.now += 10
    t.index.joined("d0", 1, total_blocks=2)  # heard again, same epoch, synced: nothing asked
    assert t.asked == [["d0"]]
    t.index.joined("d0", 2, total_blocks=2)  # restarted: what it held is gone, ask again
    assert t.index.blocks_of("d0") == 0
    assert t.asked == [["d0"], ["d0"]]
