"""The KV checksum (connector/integrity.py) and the allocation epoch, without engines.

The definition first: what changes it (one bit, two blocks swapped) and what must not (the
same bytes in another pool or another memory order, the order of summation, int64 overflow);
how a rank of another TP checks its slice. Then the two sides on CPU tensors standing in for
vLLM's cache: P's notice carries the checksum of the blocks D announced, D reports a receive
finished only when what landed matches (failed otherwise: D recomputes), says unchecked where
nothing was sent to compare, and drops words of another allocation. The engines' end-to-end
proof is tests/integration/test_connector_integrity.py and test_connector_faults.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvpush.connector.engine import TransferEngine
from kvpush.connector.integrity import (
    IntegrityCounts,
    KvSums,
    Outcome,
    SourceSums,
    checksum,
    from_parts,
    int_rows,
    part_checksums,
    wrap,
)
from kvpush.connector.layout import WHOLE, Slice, pool_layout
from kvpush.connector.params import (
    ConnectorSettings,
    DecodeWork,
    PrefillWork,
    ReceiveKind,
    TransferParams,
)
from kvpush.connector.peering import VLLM_CPU_LAYOUT, TpMismatch, tp_slices
from kvpush.connector.transfer import (
    Notice,
    NoticeKind,
    Role,
    Transfer,
    TransferEvent,
    TransferState,
    notice_decoder,
    notice_encoder,
)
from kvpush.connector.vllm.decode_side import DecodeSide
from kvpush.connector.vllm.prefill_side import PrefillSide
from kvpush.connector.vllm.runtime import WorkerRuntime
from kvpush.connector.vllm.side import Rank
from kvpush.schemas.messages import AbortAck, BlocksAnnounced, FailReason, KvFailed, WorkerRole
from kvpush.services.workers.config import WorkerConfig

LAYERS, HEADS, BLOCK, DIM = 2, 4, 8, 6  # vLLM's CPU cache: [blocks, heads, block, 2*head_dim]
TID, ALLOC = "transfer-0001", 77


def pool(blocks: int = 12, heads: int = HEADS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, heads, BLOCK, DIM, generator=gen) for _ in range(LAYERS)]


def sums_of(tensors: list[torch.Tensor], parts: int = 1) -> KvSums:
    return KvSums(pool_layout([[t] for t in tensors]), [[t] for t in tensors], parts)


def test_one_flipped_bit_and_two_swapped_blocks_change_it_and_nothing_else_does() -> None:
    kv = pool()
    sums = sums_of(kv, HEADS)
    ids = [3, 4, 9]
    base = checksum(sums.all_layers(ids))
    assert base == checksum(sums.all_layers(ids))  # deterministic
    kv[1][[3, 9]] = kv[1][[9, 3]].clone()  # the same bytes, misplaced
    swapped = checksum(sums.all_layers(ids))
    assert swapped != base
    assert sums.all_layers(ids).sum() == sums.all_layers([9, 4, 3]).sum()  # a plain sum would not
    int_rows(kv[0], pool_layout([[kv[0]]]).layers[0][0])[4, 17] ^= 1  # the lowest bit
    assert checksum(sums.all_layers(ids)) not in (base, swapped)


def test_p_takes_every_layer_s_sums_once_the_last_layer_is_in() -> None:
    """P's sums come in one pass with the last layer (the forward runs none of them per layer):
    none before, what the blocks hold then, and a flip after them is not in them."""
    kv = pool()
    sums, ids = sums_of(kv, HEADS), [3, 4, 9]
    source = SourceSums(sums, ids)
    source.add(0)
    assert source.value() is None  # a layer still to come: nothing taken yet
    rows = int_rows(kv[0], pool_layout([[kv[0]]]).layers[0][0])
    rows[4, 5] ^= 1  # layer 0 changes after it was counted in, before the last layer
    source.add(LAYERS - 1)
    taken = source.value()
    assert taken is not None and checksum(taken) == checksum(sums.all_layers(ids))
    rows[4, 5] ^= 1  # after the sums: what a fault in flight does
    assert checksum(taken) != checksum(sums.all_layers(ids))
    source.add(0)  # a layer handed over again (a replayed forward) takes nothing anew
    assert checksum(source.value()) == checksum(taken)


def test_the_same_bytes_elsewhere_in_another_memory_order_give_the_same_checksum() -> None:
    """D's pool is another tensor; a token-major (GPU-like, permuted) cache is summed over its
    bytes as they lie, which is what a WRITE copies."""
    raw = torch.randn(6, BLOCK, HEADS, DIM)  # memory order: tokens outer
    permuted = raw.permute(0, 2, 1, 3)  # logical [blocks, heads, block, dim], not contiguous
    other = torch.zeros(9, BLOCK, HEADS, DIM)
    other[[2, 7, 8]] = raw[[1, 3, 5]]
    here = KvSums(pool_layout([[permuted]]), [[permuted]])
    there = KvSums(pool_layout([[other]]), [[other]])
    assert checksum(here.all_layers([1, 3, 5])) == checksum(there.all_layers([2, 7, 8]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_kv_width_is_read_as_integers_of_that_width(dtype: torch.dtype) -> None:
    kv = [t.to(dtype) for t in pool()]
    rows = int_rows(kv[0], pool_layout([[kv[0]]]).layers[0][0])
    assert rows.element_size() == kv[0].element_size() and not rows.is_floating_point()
    assert rows.data_ptr() == kv[0].data_ptr()  # a view, no copy
    sums = sums_of(kv, HEADS).all_layers([0, 5])
    expected = rows[[0, 5]].view(2, HEADS, -1).to(torch.int64).sum(-1)
    assert np.array_equal(sums[0, 0], expected.numpy())


def test_weighting_wraps_like_int64_in_any_grouping() -> None:
    big = np.full((3, 1, 5, 4), 2**61, dtype=np.int64)  # overflows int64 many times over
    exact = sum((i + 1) * int(v) for i, v in enumerate(big.sum(axis=-1, dtype=object).reshape(-1)))
    assert checksum(big) == wrap(exact)
    assert from_parts(part_checksums(big), WHOLE) == checksum(big)
    assert from_parts(part_checksums(big), Slice(1, 2)) == checksum(big, 0, Slice(1, 2))
    assert from_parts([1, 2, 3], Slice(0, 2)) is None  # not on part bounds: cannot say


@pytest.mark.parametrize("hit", [0, 1], ids=["all-blocks", "decode-holds-one"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (4, 2)])
def test_each_rank_pair_checks_the_slice_it_moves(p_tp: int, d_tp: int, hit: int) -> None:
    """P's checksum of what a leg sends (its slice of its blocks, from D's hit on) equals D's of
    the slice of D's blocks it landed in, for every TP pair kvpush maps; so does the pull form
    (KvReady's per-part checksums, summed over the slice read) where D read every block."""
    p_pools = [pool(10, HEADS // p_tp, seed=r) for r in range(p_tp)]
    d_pools = [
        [torch.zeros(11, HEADS // d_tp, BLOCK, DIM) for _ in range(LAYERS)] for _ in range(d_tp)
    ]
    p_ids, d_ids = [1, 2, 5, 7], [4, 0, 9, 3][hit:]
    moved = HEADS // max(p_tp, d_tp)  # heads one rank pair exchanges
    pairs = 0
    for p in range(p_tp):
        for d in range(d_tp):
            try:
                mine, theirs = tp_slices(p, p_tp, d, d_tp, VLLM_CPU_LAYOUT)
            except TpMismatch:
                continue
            pairs += 1
            src, dst = mine.index * moved, theirs.index * moved
            for layer in range(LAYERS):
                block = p_pools[p][layer][p_ids[hit:], src : src + moved]
                d_pools[d][layer][d_ids, dst : dst + moved] = block
            p_sums = SourceSums(sums_of(p_pools[p], HEADS // p_tp), p_ids)
            for layer in reversed(range(LAYERS)):
                p_sums.add(layer)
            sent = checksum(p_sums.value(), hit, mine)
            got = checksum(sums_of(d_pools[d], HEADS // d_tp).all_layers(d_ids), 0, theirs)
            assert sent is not None and sent == got, (p, d)
            if not hit:
                assert from_parts(part_checksums(p_sums.value()), mine) == got
    assert pairs == max(p_tp, d_tp)


def test_a_notice_keeps_its_old_form_and_an_older_decoder_reads_the_new_one() -> None:
    plain = Notice(1, NoticeKind.DONE, "tx-1", 1, 2)
    assert notice_encoder.encode(plain) == b'[1,"done","tx-1",1,2]'
    full = Notice(1, NoticeKind.DONE, "tx-1", 0, 1, ALLOC, -5)
    assert notice_encoder.encode(full) == b'[1,"done","tx-1",0,1,77,-5]'
    assert notice_decoder.decode(notice_encoder.encode(full)) == full
    assert notice_decoder.decode(b'[1,"done","tx-1",0,1,77]').checksum is None
    import msgspec

    class Older(msgspec.Struct, array_like=True):
        version: int
        kind: str
        transfer_id: str
        sender: int = 0
        senders: int = 1

    assert msgspec.json.decode(notice_encoder.encode(full), type=Older).transfer_id == "tx-1"


def test_a_target_drops_a_notice_of_another_allocation_and_keeps_each_sender_s_checksum() -> None:
    t = Transfer(TID, Role.TARGET, None, created=0.0, deadline=10.0, alloc=ALLOC)
    stale = Notice(1, NoticeKind.DONE, TID, 0, 2, ALLOC - 1, 9)
    assert t.stale(stale)
    assert not t.stale(Notice(1, NoticeKind.DONE, TID, 0, 2))  # an older peer: no epoch
    t.on_notice(NoticeKind.DONE, 1.0, 1, 2, 11)
    t.on_notice(NoticeKind.DONE, 1.0, 0, 2, None)
    event = t.event(2.0)
    assert event is not None and event.state is TransferState.DONE
    assert event.checksums == {1: 11, 0: None}


# ---- the two sides, on CPU tensors --------------------------------------------------------


class Recorder:
    """Transport and bus in one: records calls; ``compat`` says vLLM's CPU layout."""

    compat_hash, epoch, address = "ab" * 8, 1, "tcp://127.0.0.1:1"
    config = SimpleNamespace(compat=SimpleNamespace(layout=VLLM_CPU_LAYOUT))

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.published: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> bool:
            self.calls.append((name, args, kwargs))
            return True

        return record

    def publish(self, subject: str, message: Any, context: Any = None, span: bool = True) -> None:
        self.published.append(message)

    def subscribe(self, subject: str, handler: Any) -> None:
        pass

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(args, kwargs) for call, args, kwargs in self.calls if call == name]


def decode(kv: list[torch.Tensor] | None) -> tuple[DecodeSide, Recorder]:
    rec = Recorder()
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE)
    sums = sums_of(kv, HEADS) if kv is not None else None
    side = DecodeSide(settings, rec, rec, WorkerRuntime(), Rank(), BLOCK, sums)  # type: ignore[arg-type]
    params = TransferParams(transfer_id=TID, prefill_id="p0", decode_id="d0")
    side.on_work([DecodeWork(ReceiveKind.PUSH, "r0", params, [5, 6], 0, 16, 0, ALLOC)])
    return side, rec


def done(checksums: dict[int, int | None]) -> TransferEvent:
    return TransferEvent(TID, Role.TARGET, TransferState.DONE, True, checksums=checksums)


def test_d_announces_its_allocation_and_expects_notices_of_it_only() -> None:
    _, rec = decode(pool())
    ((_, kwargs),) = rec.called("expect")
    assert kwargs["alloc"] == ALLOC
    (announced,) = [m for m in rec.published if isinstance(m, BlocksAnnounced)]
    assert announced.alloc_epoch == ALLOC


@pytest.mark.parametrize(
    ("sent", "finished", "outcome"),
    [("right", {"r0"}, "verified"), ("wrong", set(), "mismatch"), (None, {"r0"}, "unchecked")],
)
def test_d_reports_a_landed_receive_by_what_its_checksum_says(
    sent: str | None, finished: set[str], outcome: str
) -> None:
    kv = pool()
    side, _ = decode(kv)
    right = checksum(sums_of(kv, HEADS).all_layers([5, 6]))
    value = {"right": right, "wrong": right + 1, None: None}[sent]
    got, failed = side.collect([done({0: value})])
    assert got == finished and failed == ({} if finished else {"r0": [5, 6]})
    counts, outcomes = side.integrity.take()
    assert outcomes == {"r0": outcome} and counts == {outcome: 1}


def test_d_with_the_checksum_off_verifies_nothing() -> None:
    side, _ = decode(None)
    assert side.collect([done({0: 12345})]) == ({"r0"}, {})
    assert side.integrity.take() == ({"off": 1}, {"r0": "off"})


def test_d_drops_the_words_of_a_stale_sender_and_counts_them() -> None:
    side, rec = decode(pool())
    side.on_bus("", AbortAck(transfer_id=TID, prefill_id="p0", alloc_epoch=ALLOC - 1))
    side.on_bus(
        "",
        KvFailed(
            transfer_id=TID,
            prefill_id="p0",
            decode_id="d0",
            reason=FailReason.TRANSFER,
            alloc_epoch=ALLOC + 1,
        ),
    )
    stale = TransferEvent(TID, Role.TARGET, TransferState.WAITING_PEER, False, stale="a notice")
    assert side.collect([stale]) == (set(), {})
    assert not rec.called("acknowledged")  # no stale word quiesced the receive
    assert side.integrity.take()[0] == {"stale": 3}
    side.on_bus("", AbortAck(transfer_id=TID, prefill_id="p0", alloc_epoch=ALLOC))
    assert rec.called("acknowledged")


def test_p_sends_the_checksum_of_the_blocks_d_announced_from_d_s_hit_on() -> None:
    kv = pool()
    rec = Recorder()
    settings = ConnectorSettings(worker_id="p0", role=WorkerRole.PREFILL)
    side = PrefillSide(
        settings, rec, rec, WorkerRuntime(), Rank(), LAYERS, BLOCK, sums_of(kv, HEADS)
    )  # type: ignore[arg-type]
    params = TransferParams(transfer_id=TID, prefill_id="p0", decode_id="d0")
    side.on_bus(
        "",
        BlocksAnnounced(
            transfer_id=TID,
            decode_id="d0",
            decode_epoch=1,
            block_runs=[(20, 2)],
            first_token=BLOCK,  # D holds the first block's tokens
            num_tokens=3 * BLOCK - 2,
            compat_hash=Recorder.compat_hash,
            side_channel="tcp://127.0.0.1:2",
            alloc_epoch=ALLOC,
        ),
    )
    side.on_work([PrefillWork("r0", params, [3, 8, 4, 11], 3 * BLOCK - 2, True)])
    for layer in range(LAYERS):
        side.on_layer_computed(layer)
        side.on_layer_saved(layer)
    ((args, _),) = rec.called("finish")
    (tid, late) = args  # the notice waits for it, not the forward
    assert tid == TID and late.ready()
    assert late.value() == checksum(sums_of(kv, HEADS).all_layers([8, 4]))
    (start,) = rec.called("start_push")
    assert start[0][-1].alloc == ALLOC  # echoed in every notice of the push


class Late:
    """A done notice's checksum that is ready when told (``transfer.LateChecksum``)."""

    def __init__(self, value: int | Exception) -> None:
        self.is_ready, self._value = False, value

    def ready(self) -> bool:
        return self.is_ready

    def value(self) -> int | None:
        if isinstance(self._value, Exception):
            raise self._value
        return self._value


def _pushing(engine: TransferEngine, tid: str, notices: list[tuple[Any, ...]]) -> Transfer:
    """A push with every WRITE done, its notices recorded instead of sent."""
    t = engine._new(tid, Role.PUSH, "tcp://d", 5.0)
    t.to(TransferState.READY, 0.0)
    engine._notify = lambda t, kind: notices.append((t.transfer_id, kind, t.checksum)) or True  # type: ignore[method-assign]
    return t


def test_a_done_notice_waits_for_its_late_checksum_and_one_that_failed_fails_the_push() -> None:
    """P's sums run on a side stream past the forward: the done notice polls for them (the
    forward and the first token do not wait), and a checksum that could not be computed is
    no done (D recomputes: fail closed)."""
    agent = SimpleNamespace(notifications=lambda: [])
    engine = TransferEngine(
        agent,  # type: ignore[arg-type]
        pool_layout([[t] for t in pool()]),
        None,
        cancel_grace_s=1.0,
        max_transfers=8,
        max_early_notices=8,
        clock=lambda: 1.0,
    )
    notices: list[tuple[Any, ...]] = []
    t = _pushing(engine, "ok", notices)
    late = Late(1234)
    engine.finish("ok", late)
    engine.progress()
    assert notices == [] and t.state is TransferState.READY  # not yet on the host
    late.is_ready = True
    engine.progress()
    assert notices == [("ok", NoticeKind.DONE, 1234)] and t.state is TransferState.DONE
    broken = _pushing(engine, "broken", notices)
    failing = Late(RuntimeError("device lost"))
    failing.is_ready = True
    engine.finish("broken", failing)
    assert broken.state is TransferState.FAILED and "device lost" in broken.detail
    assert len(notices) == 1  # no done notice for it


def test_p_s_sums_are_awaited_on_the_kv_s_gpu_from_any_thread() -> None:
    """The poller and the gate are threads vLLM never set a device on: querying or waiting for
    the sums' event there runs with the KV's GPU current (a TP rank on GPU 3 must not open a
    context on GPU 0)."""
    from contextlib import contextmanager

    from kvpush.connector.integrity import Pending

    seen: list[tuple[str, bool]] = []
    on_device = [False]

    @contextmanager
    def kv_gpu() -> Any:
        on_device[0] = True
        try:
            yield
        finally:
            on_device[0] = False

    class Event:
        def query(self) -> bool:
            seen.append(("query", on_device[0]))
            return True

        def synchronize(self) -> None:
            seen.append(("synchronize", on_device[0]))

    pending = Pending(torch.arange(3), Event(), kv_gpu)
    assert pending.ready() and pending.value().tolist() == [0, 1, 2]
    assert seen == [("query", True), ("synchronize", True)]
    assert pending.ready() and seen == [("query", True), ("synchronize", True)]  # read once


def test_the_layer_gate_s_thread_makes_the_kv_s_gpu_its_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from kvpush.connector.vllm.gate import LayerGate

    made: list[tuple[str, str]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: made.append((d, threading.current_thread().name))
    )
    gate = LayerGate(lambda layer: None, "cuda:3")
    gate.close()
    gate._thread.join()  # close waits a bounded time; this test waits for the thread itself
    assert made == [("cuda:3", "kvpush-layer-gate")]


def test_counts_are_taken_once() -> None:
    counts = IntegrityCounts()
    counts.record("a", Outcome.MISMATCH)
    counts.stale()
    assert counts.take() == ({"mismatch": 1, "stale": 1}, {"a": "mismatch"})
    assert counts.take() == ({}, {})


@pytest.mark.parametrize(("given", "extra"), [((), True), (("--kv-checksum", "off"), False)])
def test_the_worker_flag_reaches_the_connector(given: tuple[str, ...], extra: bool) -> None:
    import argparse

    from kvpush.services.workers import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    values = config.settings.read(config.SETTINGS, parser.parse_args(list(given)), {})
    worker = WorkerConfig(WorkerRole.DECODE, "d0", "/m", "m", **values)
    kv_config = worker.engine_config().kv_transfer_config
    assert kv_config["kv_connector_extra_config"]["kv_checksum"] is extra
    assert (
        ConnectorSettings.from_extra_config(kv_config["kv_connector_extra_config"]).kv_checksum
        is extra
    )
