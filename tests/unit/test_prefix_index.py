"""The gateway's prefix index: built from CacheEvents, bounded, consistent across gaps,
restarts and workers leaving; ``matched_tokens`` is what the router asks."""

from __future__ import annotations

import argparse
import gc
import sys
from types import FrameType
from typing import Any

import pytest

from kvpush.schemas.messages import CacheEvents
from kvpush.schemas.prefix import block_hashes
from kvpush.services.gateway import config as gateway_config
from kvpush.services.gateway.prefix_index import (
    DEFAULT_MAX_BLOCKS,
    DRAIN_CHUNK,
    MAX_WORKERS,
    PrefixIndex,
)

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


def test_a_chain_counts_from_its_root() -> None:
    t = Index()
    t.snapshot("d0", OURS[1:])  # every block but the first: vLLM would reuse none of them
    assert t.match() == {}
    # a hole inside a chain is read as held (the depth is a binary search over the chain, which
    # a worker holds from its root up: vLLM evicts a chain's tail first); an estimate only
    t.snapshot("d1", [OURS[0], OURS[2], OURS[3]])
    assert t.match() == {"d1": 16}


def test_a_long_prompt_finds_each_depth() -> None:
    long_prompt = list(range(1, 4 * 300 + 3))  # 300 whole blocks and a partial one
    chain = block_hashes(long_prompt, BS)
    t = Index()
    for depth in (1, 2, 7, 128, 299, 300):
        t.snapshot(f"d{depth}", chain[:depth])
    workers = tuple(f"d{depth}" for depth in (1, 2, 7, 128, 299, 300))
    found = t.index.matched_tokens(long_prompt, workers)
    assert found == {f"d{depth}": depth * BS for depth in (1, 2, 7, 128, 299, 300)}


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
    t.index.forget("d0", 1)
    assert t.match() == {"d1": 8}
    assert len(t.index) == 2
    t.index.forget("d1", 1)
    assert len(t.index) == 0
    assert t.match() == {}


def test_per_worker_bound_is_its_pool() -> None:
    t = Index()
    t.index.set_capacity("d0", 2)
    t.snapshot("d0", OURS)  # the oldest go first: a chain's last blocks (as vLLM frees them)
    assert t.index.blocks_of("d0") == 2
    assert t.match() == {"d0": 8}  # the last blocks went
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


# ---- eviction cost, LRU, forget and its epoch, the flag ---------------------------------------
def calls_made(work: Any) -> int:
    """Python and C function calls ``work()`` makes (a count: the same on every machine). The
    garbage collector is off meanwhile: a collection that happens to fall inside ``work`` runs
    other objects' finalizers and weakref callbacks (an earlier test's garbage), whose calls
    would count too (a clean-clone run once counted 28 instead of 24)."""
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    gc.collect()
    gc.disable()
    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def full_fleet(workers: int, blocks_each: int) -> Index:
    """``workers`` workers of ``blocks_each`` entries and one of 1 ("small"), at the bound."""
    t = Index(max_blocks=workers * blocks_each + 1)
    for n in range(workers):
        t.snapshot(f"w{n}", [n * 1_000_000 + b for b in range(blocks_each)])
    t.snapshot("small", [-1])
    assert len(t.index) == t.index.max_blocks
    return t


def test_an_eviction_at_the_bound_costs_the_same_whatever_the_fleet_holds() -> None:
    costs = []
    for workers, blocks_each in ((16, 50), (256, 400)):
        t = full_fleet(workers, blocks_each)
        stored, seqs = iter(range(-2, -100, -1)), iter(range(1, 100))

        def store_one(t: Index = t, stored: Any = stored, seqs: Any = seqs) -> None:
            t.index.apply(events("small", next(seqs), stored=[next(stored)]))

        store_one()  # the first at this fleet size: who holds its fair share, found once
        assert t.index.stats.share_rebuilds == 1
        evicted = t.index.stats.evicted
        costs.append([calls_made(store_one) for _ in range(3)])
        assert t.index.stats.evicted == evicted + 3  # one entry each, of another worker
        assert t.index.blocks_of("small") == 5
        assert len(t.index) == t.index.max_blocks
        assert t.index.stats.share_rebuilds == 1
    assert costs[0] == costs[1]  # 16 workers of 50 or 256 of 400: the same work


def test_the_global_bound_evicts_from_the_worker_stored_to_once_it_holds_its_share() -> None:
    t = full_fleet(4, 10)  # 41 entries; fair share 41 // 5 = 8
    t.index.apply(events("w0", 1, stored=[-7, -8, -9]))
    assert t.index.blocks_of("w0") == 10  # its own oldest went
    assert [t.index.blocks_of(f"w{n}") for n in range(1, 4)] == [10, 10, 10]
    assert t.index.stats.evicted == 3


def test_victims_take_turns_among_the_workers_holding_their_share() -> None:
    t = full_fleet(4, 10)
    t.index.apply(events("small", 1, stored=[-2, -3, -4, -5]))
    assert [t.index.blocks_of(f"w{n}") for n in range(4)] == [9, 9, 9, 9]


def test_a_matched_prefix_outlives_entries_stored_after_it() -> None:
    t = Index(max_blocks=6)
    t.snapshot("d0", OURS)  # a long-lived system prompt, stored first
    t.index.apply(events("d0", 1, stored=OTHER))  # 6 entries: at the bound
    assert t.match(workers=("d0",)) == {"d0": 16}  # asked for: now the newest
    t.index.apply(events("d0", 2, stored=[5, 6]))  # the least recently used go: OTHER
    assert t.match(workers=("d0",)) == {"d0": 16}
    assert t.match([9, 9, 9, 9, 8, 8, 8, 8], ("d0",)) == {}
    assert t.index.stats.evicted == 2


def test_a_match_near_the_bound_outlives_entries_stored_after_it() -> None:
    t = Index(max_blocks=10)
    t.snapshot("d0", OURS)  # stored first: the oldest
    t.index.apply(events("d0", 1, stored=[21, 22, 23, 24, 25]))  # 9 entries: 90 % of the bound
    assert t.match(workers=("d0",)) == {"d0": 16}  # near the bound a match is a use
    t.index.apply(events("d0", 2, stored=[26, 27, 28]))  # three evicted: the oldest unmatched
    assert t.match(workers=("d0",)) == {"d0": 16}
    assert t.index.stats.evicted == 2


def test_a_matched_chain_loses_its_leaves_before_its_root() -> None:
    t = Index()
    t.index.set_capacity("d0", 4)
    t.snapshot("d0", OURS)
    assert t.match(workers=("d0",)) == {"d0": 16}
    t.index.apply(events("d0", 1, stored=[5]))  # the chain's last block goes, not its first
    assert t.match(workers=("d0",)) == {"d0": 12}  # ... and the rest is the newest again
    t.index.apply(events("d0", 2, stored=[6]))  # so the unmatched one goes
    assert t.match(workers=("d0",)) == {"d0": 12}
    assert t.index.blocks_of("d0") == 4


def test_forget_leaves_a_newer_epoch_alone() -> None:
    t = Index()
    t.snapshot("d0", OURS, epoch=2)  # restarted: its snapshot came before the old one's leave
    t.index.forget("d0", 1)
    assert t.match() == {"d0": 16}
    t.index.forget("d0", 2)
    assert t.match() == {}


def test_late_messages_after_forget_are_ignored_and_the_pool_size_is_kept() -> None:
    t = Index()
    t.index.joined("d0", 1, total_blocks=2)
    t.snapshot("d0", OURS)
    t.index.forget("d0", 1)
    t.index.apply(events("d0", 1, stored=OTHER))  # late: the incarnation that left
    assert t.index.stats.stale == 1
    assert t.index.blocks_of("d0") == 0
    t.snapshot("d0", OURS, epoch=2)  # restarted, before its heartbeat: the old pool's bound
    assert t.index.blocks_of("d0") == 2
    t.index.forget("d0", 2)
    t.index.joined("d0", 2, total_blocks=3)  # heard again (cut off, not restarted)
    assert t.asked[-1] == ["d0"]
    t.snapshot("d0", OURS, epoch=2)
    assert t.index.blocks_of("d0") == 3
    t.index.joined("d0", 1, total_blocks=3)  # an older incarnation: ignored
    assert t.index.blocks_of("d0") == 3


def test_forget_only_marks_and_the_entries_are_freed_in_chunks() -> None:
    t = Index()
    held = DRAIN_CHUNK + 10
    t.snapshot("d0", list(range(1000, 1000 + held)))
    t.snapshot("d1", OURS)
    t.index.forget("d0", 1)  # on the request path: no entry is touched
    assert t.index.blocks_of("d0") == 0
    assert len(t.index) == 4
    assert t.index.pending_drop == held
    assert t.match() == {"d1": 16}
    t.index.apply(events("d1", 1))  # each apply frees a chunk
    assert t.index.pending_drop == 10
    t.index.apply(events("d1", 2))
    assert t.index.pending_drop == 0


def test_entries_waiting_to_be_freed_count_against_the_bound_and_go_first() -> None:
    t = Index(max_blocks=DRAIN_CHUNK + 10)
    t.snapshot("d0", list(range(1000, 1000 + DRAIN_CHUNK + 6)))
    t.snapshot("d0", OURS, seq=1)  # cleared: the old entries wait, then a chunk is freed
    assert t.index.pending_drop == 6
    t.snapshot("d1", OTHER)  # room from the waiting entries, not from d0's
    assert t.index.blocks_of("d0") == 4
    assert t.index.stats.evicted == 0
    assert len(t.index) + t.index.pending_drop <= t.index.max_blocks


def test_the_bound_is_a_gateway_flag() -> None:
    parser = argparse.ArgumentParser()
    gateway_config.add_arguments(parser)

    def configured(*flags: str, **env: str) -> int:
        args = parser.parse_args(["--model", "m", *flags])
        return gateway_config.GatewayConfig.from_args(args, env).prefix_index_max_blocks

    assert configured() == DEFAULT_MAX_BLOCKS == 500_000
    assert configured(KVPUSH_PREFIX_INDEX_MAX_BLOCKS="1000") == 1000
    assert configured("--prefix-index-max-blocks", "7", KVPUSH_PREFIX_INDEX_MAX_BLOCKS="9") == 7
    with pytest.raises(gateway_config.ConfigError):
        configured("--prefix-index-max-blocks", "0")
