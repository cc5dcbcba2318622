"""The worker side of the prefix index: vLLM's KV cache events, in its ZMQ publisher's wire form
(a msgpack array [ts, events, dp_rank], each event a map tagged ``type``: vLLM stays out of
the test process; the integration test reads a real engine's), mirrored as prefix hashes and
published as CacheEvents."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvpush.schemas import decode, encode, subjects
from kvpush.schemas.messages import CacheEvents, CacheSync, WorkerRole
from kvpush.schemas.prefix import block_hashes
from kvpush.services.workers.cache_events import CacheEventReader
from kvpush.services.workers.cache_publisher import CachePublisher, chunks

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
    assert feed(stored([b"e1", b"e2", b"e3"], PROMPT)) == (OURS[1:], OURS[:1], False)
    assert len(feed.reader.mirror) == 2


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
