"""The worker side of the prefix index: vLLM's KV cache events, in its ZMQ publisher's wire form
(a msgpack array [ts, events, dp_rank], each event a map tagged ``type``: vLLM stays out of
the test process; the integration test reads a real engine's), mirrored as prefix hashes and
published as CacheEvents."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpush.schemas import decode, encode, subjects
from kvpush.schemas.messages import CacheEvents, CacheSync, WorkerRole
from kvpush.schemas.prefix import block_hashes
from kvpush.services.workers import cache_events
from kvpush.services.workers.cache_events import CacheEventReader, PendingChanges
from kvpush.services.workers.cache_publisher import CachePublisher, chunks
from kvpush.services.workers.events_socket import IPC_PATH_MAX, ipc_endpoint

BS = 4
PACK = msgspec.msgpack.Encoder()
Event = dict[str, Any]


def stored(hashes: list[Any], tokens: list[int], parent: Any = None, **extra: Any) -> Event:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[Any]) -> Event:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


CLEARED: Event = {"type": "AllBlocksCleared"}


def batch(*events: Event) -> bytes:
    return PACK.encode([1.0, list(events), 0])


class Feed:
    """A reader fed by hand, in vLLM's sequence order."""

    def __init__(self, capacity: int = 100) -> None:
        self.reader = CacheEventReader("ipc:///nonexistent", capacity)
        self.seq = 0

    def __call__(self, *events: Event, seq: int | None = None) -> tuple[list[int], list[int], bool]:
        self.seq = self.seq if seq is None else seq
        self.reader.feed(self.seq, batch(*events))
        self.seq += 1
        changes = self.reader.take()
        return (*changes.split(), changes.cleared)


PROMPT = list(range(1, 13))  # three blocks
OURS = block_hashes(PROMPT, BS)


def test_stored_blocks_become_prefix_hashes_chained_through_the_parent() -> None:
    feed = Feed()
    assert feed(stored([b"e1", b"e2"], PROMPT[:8])) == (OURS[:2], [], False)
    assert feed(stored([b"e3"], PROMPT[8:], parent=b"e2")) == (OURS[2:], [], False)
    assert feed.reader.mirror.block_size == BS
    assert feed(removed([b"e2"])) == ([], [OURS[1]], False)
    assert sorted(feed.reader.snapshot()[0]) == sorted([OURS[0], OURS[2]])


def test_int_engine_hashes_and_a_reused_block_are_one_entry() -> None:
    feed = Feed()
    assert feed(stored([11], PROMPT[:4])) == (OURS[:1], [], False)
    assert feed(stored([11], PROMPT[:4])) == ([], [], False)  # vLLM reports reuse so
    assert len(feed.reader.mirror) == 1


def test_cleared_drops_everything_and_says_so() -> None:
    feed = Feed()
    feed(stored([b"e1"], PROMPT[:4]))
    assert feed(CLEARED) == ([], [], True)
    assert feed.reader.snapshot()[0] == []


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"lora_name": "adapter"}, "lora"),
        ({"extra_keys": [("mm-hash", 0)]}, "extra_keys"),
        ({"medium": "STORAGE"}, "medium"),
        ({"medium": "CPU"}, "medium"),  # vLLM's offload tier: the engine's pool says "GPU"
        ({"group_idx": 1}, "group"),
    ],
)
def test_blocks_with_extra_keys_or_another_medium_are_counted_not_indexed(
    extra: dict[str, Any], why: str
) -> None:
    feed = Feed()
    assert feed(stored([b"e1"], PROMPT[:4], **extra)) == ([], [], False)
    assert feed.reader.mirror.skipped == {why: 1}


def test_a_block_of_an_unknown_parent_is_an_orphan() -> None:
    feed = Feed()
    assert feed(stored([b"e9"], PROMPT[4:8], parent=b"unknown")) == ([], [], False)
    assert feed.reader.mirror.skipped == {"orphan": 1}


def test_a_sequence_gap_clears_the_mirror() -> None:
    feed = Feed()
    feed(stored([b"e1"], PROMPT[:4]))
    assert feed(stored([b"e2"], PROMPT[4:8], parent=b"e1"), seq=5) == ([], [], True)
    assert feed.reader.gaps == 1
    assert feed.reader.mirror.skipped == {"orphan": 1}  # its parent went with the gap


def test_the_mirror_is_bounded_by_the_pool() -> None:
    feed = Feed(capacity=2)
    # e1 went before it was published: nothing to say of it
    assert feed(stored([b"e1", b"e2", b"e3"], PROMPT)) == (OURS[1:], [], False)
    assert len(feed.reader.mirror) == 2
    assert feed(stored([b"e1"], PROMPT[:4])) == (OURS[:1], [OURS[2]], False)  # the tail


def test_a_reused_prefix_is_refreshed_without_bus_traffic_and_its_head_goes_last() -> None:
    feed = Feed(capacity=3)
    feed(stored([b"e1", b"e2"], PROMPT[:8]))
    feed(stored([b"e3"], PROMPT[8:], parent=b"e2"))
    assert feed(stored([b"e1", b"e2"], PROMPT[:8])) == ([], [], False)  # a hit, "full" mode
    other = block_hashes([7] * BS, BS)
    assert feed(stored([b"x"], [7] * BS)) == (other, [OURS[2]], False)  # e3: least recent
    assert feed(stored([b"y"], [8] * BS))[1] == [OURS[1]]  # then e2: the chain's tail first


def test_a_hit_after_a_clear_indexes_the_prefix_again_and_what_extends_it() -> None:
    feed = Feed()
    feed(stored([b"e1", b"e2"], PROMPT[:8]))
    feed(CLEARED)
    assert feed(stored([b"e3"], PROMPT[8:], parent=b"e2")) == ([], [], False)  # an orphan
    # vLLM's "full" report of a hit: the whole prefix from the first block, no parent
    assert feed(stored([b"e1", b"e2"], PROMPT[:8])) == (OURS[:2], [], False)
    assert feed(stored([b"e3"], PROMPT[8:], parent=b"e2")) == (OURS[2:], [], False)
    assert feed.reader.mirror.skipped == {"orphan": 1}


def test_chunks_split_and_bound() -> None:
    assert chunks([], [], 3) == [([], [])]
    assert chunks([1, 2, 3, 4], [9], 3) == [([1, 2], [9]), ([3, 4], [])]
    parts = chunks(list(range(10)), list(range(100, 105)), 4)
    assert all(len(s) + len(r) <= 4 for s, r in parts)
    assert [h for s, _ in parts for h in s] == list(range(10))
    assert [h for _, r in parts for h in r] == list(range(100, 105))


class FakeBus:
    def __init__(self) -> None:
        self.sent: list[CacheEvents] = []

    async def publish(self, subject: str, message: Any, *, span: bool = True) -> None:
        self.sent.append(decode(subject, encode(message)))  # type: ignore[arg-type]

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_the_publisher_sends_changes_then_snapshots_in_sequence() -> None:
    async def scenario() -> list[CacheEvents]:
        bus, feed, epoch = FakeBus(), Feed(), [7]
        reader, role = feed.reader, WorkerRole.DECODE
        publisher = CachePublisher(bus, reader, role, "d0", lambda: epoch[0])  # type: ignore[arg-type]
        feed.reader.feed(0, batch(stored([b"e1", b"e2"], PROMPT[:8])))
        await publisher.publish_round()
        feed.reader.feed(1, batch(removed([b"e2"])))
        await publisher.publish_round()
        await publisher.publish_round()  # nothing new: nothing sent
        await publisher.on_sync(subjects.cache_sync(), CacheSync(sender="gw", workers=["d9"]))
        await publisher.publish_round()  # not for us
        await publisher.on_sync(subjects.cache_sync(), CacheSync(sender="gw"))
        await publisher.publish_round()
        epoch[0] = 8  # rejoined: a snapshot, seq from 0
        await publisher.publish_round()
        return bus.sent

    sent = asyncio.run(scenario())
    summary = [(m.epoch, m.seq, m.stored, m.removed, m.cleared, m.snapshot) for m in sent]
    assert summary == [
        (7, 0, OURS[:2], [], False, False),
        (7, 1, [], [OURS[1]], False, False),
        (7, 2, [OURS[0]], [], True, True),
        (8, 0, [OURS[0]], [], True, True),
    ]
    assert all(m.block_size == BS and m.worker_id == "d0" and m.last for m in sent)


# ---- pending changes: net changes, bounded -------------------------------------------------
def test_a_hash_stored_and_removed_before_it_was_published_leaves_nothing() -> None:
    changes = PendingChanges()
    changes.store(1)
    changes.remove(1)
    assert not changes and changes.held == {}
    changes.remove(2)  # published before: gateways must drop it, whatever follows
    changes.store(2)
    changes.remove(2)
    assert changes.split() == ([], [2])
    changes.clear()
    changes.remove(3)  # gateways hold nothing of before a clear
    assert changes.cleared and changes.held == {}


def test_changes_past_the_limit_become_a_snapshot() -> None:
    changes = PendingChanges(limit=2)
    for prefix_hash in (1, 2, 3):
        changes.remove(prefix_hash)
    assert changes.overflowed and changes.held == {} and changes
    changes.store(4)
    assert changes.held == {}  # the snapshot will hold it


LONG = list(range(1, 17))  # four blocks
LONG_OURS = block_hashes(LONG, BS)


def publisher_of(feed: Feed, fake_bus: FakeBus | None = None) -> tuple[CachePublisher, FakeBus]:
    fake_bus = fake_bus or FakeBus()
    publisher = CachePublisher(fake_bus, feed.reader, WorkerRole.DECODE, "d0", lambda: 7)  # type: ignore[arg-type]
    return publisher, fake_bus


def test_a_stalled_publisher_s_overflow_is_published_as_a_snapshot() -> None:
    async def scenario() -> list[CacheEvents]:
        feed = Feed(capacity=2)
        publisher, bus = publisher_of(feed)
        feed(stored([b"e1", b"e2"], LONG[:8]), seq=0)  # taken: as if published
        feed.reader.feed(1, batch(stored([b"e3", b"e4"], LONG[8:], parent=b"e2")))
        await publisher.publish_round()
        return bus.sent

    sent = asyncio.run(scenario())
    # e1, e2 removed and e3, e4 stored: 4 changes, past the limit (2)
    assert [(sorted(m.stored), m.removed, m.cleared, m.snapshot) for m in sent] == [
        (sorted(LONG_OURS[2:]), [], True, True)
    ]


# ---- failures: a batch, the reader thread, the start ---------------------------------------
def test_a_batch_that_fails_to_apply_clears_the_mirror_and_reading_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = Feed()
    feed(stored([b"e1"], PROMPT[:4]))

    def broken(*args: Any) -> list[int]:
        raise ValueError("a bug")

    monkeypatch.setattr(cache_events, "block_hashes", broken)
    assert feed(stored([b"e2"], PROMPT[4:8], parent=b"e1")) == ([], [], True)
    assert feed.reader.gaps == 1 and len(feed.reader.mirror) == 0
    monkeypatch.undo()
    assert feed(stored([b"e1"], PROMPT[:4])) == (OURS[:1], [], False)


class BrokenSocket:
    """What the reader thread polls: fails at once."""

    def __init__(self) -> None:
        self.closed = False

    def poll(self, timeout_ms: int) -> int:
        raise zmq.ZMQError(zmq.ETERM)

    def close(self, linger: int | None = None) -> None:
        self.closed = True


def test_a_reader_thread_that_dies_has_the_publisher_report_the_cache_cleared() -> None:
    async def scenario() -> tuple[list[CacheEvents], int]:
        feed = Feed()
        publisher, bus = publisher_of(feed)
        woken: list[bool] = []
        feed.reader.on_ready = lambda: woken.append(True)
        feed.reader.feed(0, batch(stored([b"e1"], PROMPT[:4])))
        await publisher.publish_round()
        socket = BrokenSocket()
        feed.reader._socket = socket  # type: ignore[assignment]
        feed.reader._run()  # the thread's body, on this thread
        assert socket.closed and feed.reader.failed
        await publisher.publish_round()
        return bus.sent, len(woken)

    sent, woken = asyncio.run(scenario())
    assert [(m.seq, m.stored, m.cleared) for m in sent] == [(0, OURS[:1], False), (1, [], True)]
    assert woken == 2  # the store, then the failure


class RefusingBus(FakeBus):
    def __init__(self, refuse: bool) -> None:
        super().__init__()
        self.refuse, self.subscribed = refuse, 0

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        self.subscribed += 1
        if self.refuse:
            raise RuntimeError("the bus is closing")


def readers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvpush-kv-events" and t.is_alive()]


def test_a_start_that_fails_leaves_nothing_running(tmp_path: Path) -> None:
    async def scenario(fake_bus: RefusingBus, endpoint: str) -> None:
        await CachePublisher.open(fake_bus, WorkerRole.DECODE, "d0", endpoint, 8, lambda: 7)  # type: ignore[arg-type]

    too_long = "ipc:///tmp/" + "x" * (IPC_PATH_MAX + 1)
    bus = RefusingBus(refuse=False)
    with pytest.raises(zmq.ZMQError):
        asyncio.run(scenario(bus, too_long))
    assert bus.subscribed == 0 and not readers_alive()
    bus = RefusingBus(refuse=True)
    with pytest.raises(RuntimeError):
        asyncio.run(scenario(bus, ipc_endpoint("kvpush-test-events", str(tmp_path))))
    assert bus.subscribed == 1 and not readers_alive()
