"""The state machines of the vLLM adapter's two sides (``Outgoing`` on P, ``Incoming`` on D),
driven through their public entry points with a recording transport and bus.

These are protocol-logic tests: what each side asks of the transport and says on the bus, and in
which state it leaves a transfer. That the KV really moves is the integration suite's job (real
engines, real NIXL, real nats-server); here a step cannot be skipped without a test failing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.connector.layout import WHOLE, Slice
from kvpush.connector.params import (
    ConnectorSettings,
    DecodeWork,
    PrefillWork,
    ReceiveKind,
    TransferParams,
)
from kvpush.connector.peering import VLLM_CPU_LAYOUT
from kvpush.connector.transfer import InvalidTransition, Role, TransferEvent, TransferState
from kvpush.connector.vllm.decode_side import DecodeSide
from kvpush.connector.vllm.incoming import IncomingState
from kvpush.connector.vllm.outgoing import OutgoingState
from kvpush.connector.vllm.prefill_side import PrefillSide
from kvpush.connector.vllm.runtime import TimingMarks, WorkerRuntime
from kvpush.connector.vllm.side import Rank
from kvpush.schemas.messages import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    FailReason,
    KvFailed,
    KvPushed,
    KvPushing,
    KvReady,
    TransferMode,
    WorkerRole,
)

OURS, THEIRS = "ab" * 8, "cd" * 8
TID = "transfer-0001"
LAYERS, BLOCK = 3, 4


class Recorder:
    """Transport and bus in one: every call is recorded as (name, args)."""

    compat_hash, epoch, address = OURS, 1, "tcp://127.0.0.1:1"
    config = SimpleNamespace(compat=SimpleNamespace(layout=VLLM_CPU_LAYOUT))

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.published: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> bool:
            self.calls.append((name, (*args, *kwargs.values())))
            return True

        return record

    def publish(self, subject: str, message: Any, context: Any = None, span: bool = True) -> None:
        self.published.append((subject, message))

    def subscribe(self, subject: str, handler: Any) -> None:
        pass

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def messages(self, kind: type) -> list[Any]:
        return [m for _, m in self.published if isinstance(m, kind)]


def params(mode: TransferMode = TransferMode.PUSH) -> TransferParams:
    return TransferParams(transfer_id=TID, prefill_id="p0", decode_id="d0", mode=mode)


def event(state: TransferState, role: Role = Role.PUSH) -> TransferEvent:
    return TransferEvent(TID, role, state, quiesced=True)


def prefill_side(rec: Recorder, rank: int = 0) -> tuple[PrefillSide, WorkerRuntime]:
    runtime = WorkerRuntime()
    settings = ConnectorSettings(worker_id="p0", role=WorkerRole.PREFILL)
    side = PrefillSide(settings, rec, rec, runtime, Rank(rank, 2 if rank else 1), LAYERS, BLOCK)  # type: ignore[arg-type]
    return side, runtime


def decode_side(rec: Recorder) -> tuple[DecodeSide, WorkerRuntime]:
    runtime = WorkerRuntime()
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE)
    return DecodeSide(settings, rec, rec, runtime, Rank(), BLOCK), runtime  # type: ignore[arg-type]


def announcement(compat: str = OURS, rank: int = 0, tp: int = 1) -> BlocksAnnounced:
    return BlocksAnnounced(
        transfer_id=TID,
        decode_id="d0",
        decode_epoch=1,
        block_runs=[(10, 2)],
        first_token=0,
        num_tokens=8,
        compat_hash=compat,
        side_channel="tcp://127.0.0.1:2",
        rank=rank,
        tp=tp,
    )


def work(completes: bool) -> list[PrefillWork]:
    return [PrefillWork("r0", params(), [0, 1], 8, completes)]


def test_push_streams_layers_then_settles_and_releases_once_the_request_ended() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_bus("", announcement())  # before the request: kept for it
    side.on_work(work(completes=False))
    out = side._by_tid[TID]
    assert out.state is OutgoingState.WAITING and len(side._by_tid) == 1
    side.on_work(work(completes=True))
    assert out.state is OutgoingState.STREAMING and rec.names() == ["start_push"]
    for layer in range(LAYERS):
        side.on_layer_saved(layer)
    assert rec.names() == ["start_push", "push_layers", "push_layers", "push_layers", "finish"]
    assert out.state is OutgoingState.POSTED
    assert side.collect(set(), [event(TransferState.DONE)]) == set()  # request still running
    assert out.state is OutgoingState.SETTLED and len(rec.messages(KvPushed)) == 1
    assert side.collect({"r0"}, []) == {"r0"} and not side._by_tid


def test_a_tp_rank_takes_only_its_rank_pairs_messages_and_aborts_for_every_rank() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec, rank=1)
    side.on_work(work(completes=True))
    side.on_bus("", announcement(rank=0, tp=2))  # rank 0 of D pairs with rank 0 of P: not ours
    assert side._by_tid[TID].state is OutgoingState.WAITING and rec.names() == []
    side.on_bus("", announcement(rank=1, tp=2))
    assert side._by_tid[TID].state is OutgoingState.STREAMING and rec.names() == ["start_push"]
    side.on_bus("", Abort(transfer_id=TID, sender="gw", reason="client gone"))  # rank None
    assert rec.names()[-1] == "abort"
    for layer in range(LAYERS):
        side.on_layer_saved(layer)
    side.collect({"r0"}, [event(TransferState.ABORTED)])
    acks = rec.messages(AbortAck)
    assert len(acks) == 1 and (acks[0].rank, acks[0].tp) == (1, 2)  # P's rank 1 answers


@pytest.mark.parametrize(
    ("mine", "peer", "related"),
    [
        ((0, 1), (0, 1), True),
        ((1, 2), (1, 2), True),
        ((1, 2), (0, 2), False),
        ((0, 1), (1, 2), True),  # D of 1 takes from both ranks of a P of 2
        ((1, 2), (0, 1), True),  # ... and P's rank 1 takes D's announcement
        ((1, 4), (0, 2), True),
        ((2, 4), (0, 2), False),
        ((1, 3), (1, 2), True),  # heads [1/3, 2/3) and [1/2, 1) overlap
        ((0, 3), (1, 2), False),
    ],
)
def test_ranks_pair_by_overlapping_kv_heads(
    mine: tuple[int, int], peer: tuple[int, int], related: bool
) -> None:
    assert Rank(*mine).overlaps(*peer) is related


def test_an_announcement_of_another_layout_is_refused_before_any_write() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work(work(completes=True))
    side.on_bus("", announcement(compat=THEIRS))
    (failed,) = rec.messages(KvFailed)
    assert failed.reason is FailReason.INCOMPATIBLE and THEIRS in failed.detail
    assert "start_push" not in rec.names()
    assert side._by_tid[TID].outcome is TransferState.FAILED


def test_an_abort_while_streaming_waits_for_the_quiesced_event() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work(work(completes=True))
    side.on_bus("", announcement())
    side.on_bus("", Abort(transfer_id=TID, sender="d0", reason="client gone"))
    out = side._by_tid[TID]
    assert out.state is OutgoingState.STREAMING and rec.names()[-1] == "abort"
    side.collect({"r0"}, [event(TransferState.ABORTED)])
    assert rec.messages(AbortAck) and TID not in side._by_tid


def test_transitions_outside_the_diagram_are_refused() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work(work(completes=False))
    out = side._by_tid[TID]
    out.advance(OutgoingState.POSTED)
    with pytest.raises(InvalidTransition, match="posted -> streaming"):
        out.advance(OutgoingState.STREAMING)
    out.advance(OutgoingState.SETTLED, TransferState.DONE)
    with pytest.raises(InvalidTransition):
        out.advance(OutgoingState.SETTLED, TransferState.DONE)


def receive(kind: ReceiveKind, mode: TransferMode) -> list[DecodeWork]:
    return [DecodeWork(kind, "r0", params(mode), [5, 6], 0, 8)]


def test_decode_push_abort_holds_the_blocks_until_prefill_acknowledges() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    side.on_work(receive(ReceiveKind.PUSH, TransferMode.PUSH))
    inc = side._by_tid[TID]
    assert inc.state is IncomingState.RECEIVING and rec.messages(BlocksAnnounced)
    side.on_work(receive(ReceiveKind.ABORT, TransferMode.PUSH))
    assert inc.state is IncomingState.ABORTING and rec.messages(Abort)
    assert side.collect([]) == (set(), {})  # nothing reported before P's word
    side.on_bus("", AbortAck(transfer_id=TID, prefill_id="p0"))
    assert rec.names()[-1] == "acknowledged"
    finished, failed = side.collect([event(TransferState.ABORTED, Role.TARGET)])
    assert finished == {"r0"} and failed == {}  # the request ended: nothing to recompute
    assert not side._by_tid


def test_decode_pull_refuses_a_kv_ready_of_another_layout_and_recomputes() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    side.on_work(receive(ReceiveKind.PULL, TransferMode.PULL))
    assert side._by_tid[TID].state is IncomingState.WAITING
    ready = KvReady(
        transfer_id=TID,
        prefill_id="p0",
        prefill_epoch=1,
        block_runs=[(0, 2)],
        num_tokens=8,
        compat_hash=THEIRS,
        side_channel="tcp://127.0.0.1:3",
    )
    side.on_bus("", ready)
    assert "start_pull" not in rec.names() and rec.messages(Abort)
    assert side.collect([]) == (set(), {"r0": [5, 6]})  # failed: D computes the prompt itself


def test_push_start_is_hinted_and_decode_then_polls_its_rank_at_full_rate() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work(work(completes=True))
    side.on_bus("", announcement())
    (hint,) = rec.messages(KvPushing)
    assert (hint.transfer_id, hint.decode_id, hint.rank, hint.tp) == (TID, "d0", 0, 1)
    drec = Recorder()
    dside, _ = decode_side(drec)
    dside.on_bus("", KvPushing(transfer_id=TID, prefill_id="p0", decode_id="d0"))
    assert drec.names()[-1] == "hurry"


def test_a_transfer_settled_on_the_bus_thread_wakes_the_driver() -> None:
    """An Abort (or a refused announcement) settles a transfer off the engine thread: only a
    step frees its blocks, so the side must wake the driver, which may sleep long."""
    woken: list[int] = []
    runtime = WorkerRuntime(lambda: woken.append(1))
    rec = Recorder()
    settings = ConnectorSettings(worker_id="p0", role=WorkerRole.PREFILL)
    side = PrefillSide(settings, rec, rec, runtime, Rank(), LAYERS, BLOCK)  # type: ignore[arg-type]
    side.on_work(work(completes=False))
    assert woken == []
    side.on_bus("", Abort(transfer_id=TID, sender="d0", reason="decode computes it"))
    assert side._by_tid[TID].settled and woken == [1]
    side.on_bus("", Abort(transfer_id="transfer-other", sender="d0"))  # unknown: acked, no wake
    assert woken == [1]
    runtime.timer.close()


def test_an_abort_of_a_transfer_not_held_here_is_acknowledged_and_never_pushed() -> None:
    """D aborts a receive whose request P never started (aborted before the engine scheduled
    it, e.g. as P rejoined after a stall) or already ended: P says so at once, else D would
    keep the blocks for ever; a request of it that still comes is aborted before any WRITE."""
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_bus("", announcement())
    side.on_bus("", Abort(transfer_id=TID, sender="d0", reason="moved"))
    assert [ack.transfer_id for ack in rec.messages(AbortAck)] == [TID]
    side.on_work(work(completes=True))  # the request comes after all
    assert "start_push" not in rec.names() and side._by_tid[TID].settled
    assert side.collect({"r0"}, []) == {"r0"} and not side._by_tid
    side.on_bus("", Abort(transfer_id=TID, sender="d0", reason="again"))  # ended: acked again
    assert len(rec.messages(AbortAck)) == 3  # the first, the settle's, this one


def test_timing_marks_keep_the_first_start_and_the_last_ranks_end() -> None:
    marks = TimingMarks()
    marks.record(TID, prefill_start=5, kv_landed=10)
    marks.record(TID, prefill_start=7, kv_landed=30)  # rank 1 landed later
    marks.record(TID, kv_landed=20)
    timing = marks.take(TID)
    assert timing is not None and (timing.prefill_start, timing.kv_landed) == (5, 30)


# ---- a different TP on the two sides: one leg per peer rank that holds our KV heads ---------


def _legs(rec: Recorder, name: str) -> list[tuple[Any, ...]]:
    return [args for call, args in rec.calls if call == name]


def leg_event(leg_id: str, state: TransferState, role: Role = Role.PUSH) -> TransferEvent:
    return TransferEvent(leg_id, role, state, quiesced=True, bytes=100, ended_ns=5)


def streaming_to(rec: Recorder, *d_ranks: int) -> PrefillSide:
    """P of TP 1, its request's last step done (every layer saved), announced by these ranks of
    a D of TP 2."""
    side, _ = prefill_side(rec)
    side.on_work(work(completes=True))
    for rank in d_ranks:
        side.on_bus("", announcement(rank=rank, tp=2))
    for layer in range(LAYERS):
        side.on_layer_saved(layer)
    return side


def test_p_of_tp1_pushes_each_half_of_its_blocks_to_one_rank_of_a_d_of_tp2() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)  # rank 0 of 1
    side.on_work(work(completes=True))
    side.on_bus("", announcement(rank=1, tp=2))
    out = side._by_tid[TID]
    assert out.state is OutgoingState.STREAMING
    for layer in range(LAYERS):
        side.on_layer_saved(layer)
    assert out.state is OutgoingState.STREAMING  # D's rank 0 has not announced yet
    side.on_bus("", announcement(rank=0, tp=2))  # late: every computed layer posted at once
    assert out.state is OutgoingState.POSTED
    (first, second) = _legs(rec, "start_push")
    assert (first[0], first[-1].parts, first[-1].remote_id) == (
        f"{TID}>1",
        (Slice(1, 2), WHOLE),
        TID,
    )
    assert (second[0], second[-1].parts) == (f"{TID}>0", (Slice(0, 2), WHOLE))
    assert first[-1].senders == second[-1].senders == 1  # each D rank hears from us alone
    assert [a[0] for a in _legs(rec, "finish")] == [f"{TID}>1", f"{TID}>0"]
    assert len(_legs(rec, "push_layers")) == LAYERS + 1
    side.collect(set(), [leg_event(f"{TID}>1", TransferState.DONE)])
    assert not out.settled  # the other leg is still in flight
    side.collect({"r0"}, [leg_event(f"{TID}>0", TransferState.DONE)])
    (pushed,) = rec.messages(KvPushed)
    assert pushed.bytes == 200 and TID not in side._by_tid


def test_p_rank_of_tp2_writes_its_whole_block_into_its_half_of_a_d_of_tp1() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec, rank=1)  # rank 1 of 2
    side.on_work(work(completes=True))
    side.on_bus("", announcement(rank=0, tp=1))
    ((leg_id, *_, spec),) = _legs(rec, "start_push")
    assert leg_id == TID and spec.parts == (WHOLE, Slice(1, 2))
    assert (spec.sender, spec.senders) == (1, 2)  # D counts two notices


def test_a_leg_that_fails_settles_the_transfer_failed_once_every_leg_is_quiet() -> None:
    rec = Recorder()
    side = streaming_to(rec, 0, 1)
    side.collect(set(), [leg_event(f"{TID}>0", TransferState.FAILED)])
    assert not side._by_tid[TID].settled and not rec.messages(KvFailed)
    side.collect({"r0"}, [leg_event(f"{TID}>1", TransferState.DONE)])
    (failed,) = rec.messages(KvFailed)
    assert failed.rank == 0 and not rec.messages(KvPushed) and TID not in side._by_tid


def test_an_abort_aborts_every_started_leg_and_no_late_announcement_starts_one() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work(work(completes=True))
    side.on_bus("", announcement(rank=0, tp=2))
    side.on_bus("", Abort(transfer_id=TID, sender="d0", reason="client gone"))
    side.on_bus("", announcement(rank=1, tp=2))
    assert [a[0] for a in _legs(rec, "start_push")] == [f"{TID}>0"]
    assert [a[0] for a in _legs(rec, "abort")] == [f"{TID}>0"]
    side.collect({"r0"}, [leg_event(f"{TID}>0", TransferState.ABORTED)])
    assert len(rec.messages(AbortAck)) == 1 and TID not in side._by_tid


def test_tp_sizes_that_do_not_divide_are_refused_before_any_write() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec, rank=1)  # rank 1 of 2
    side.on_work(work(completes=True))
    side.on_bus("", announcement(rank=1, tp=3))
    (failed,) = rec.messages(KvFailed)
    assert failed.reason is FailReason.INCOMPATIBLE and "tensor parallel 3" in failed.detail
    assert "one must divide the other" in failed.detail and not _legs(rec, "start_push")


def test_a_deadline_with_one_decode_rank_silent_fails_once_the_started_leg_is_quiet() -> None:
    rec = Recorder()
    side = streaming_to(rec, 0)
    out = side._by_tid[TID]
    out.deadline = 0.0  # D's rank 1 never announced
    side.collect(set(), [])
    assert out.stopping is not None and out.state is OutgoingState.POSTED
    side.collect({"r0"}, [leg_event(TID + ">0", TransferState.DONE)])
    (failed,) = rec.messages(KvFailed)
    assert failed.reason is FailReason.DEADLINE and TID not in side._by_tid


def ready(rank: int, tp: int) -> KvReady:
    return KvReady(
        transfer_id=TID,
        prefill_id="p0",
        prefill_epoch=1,
        block_runs=[(0, 2)],
        num_tokens=8,
        compat_hash=OURS,
        side_channel=f"tcp://127.0.0.1:{10 + rank}",
        rank=rank,
        tp=tp,
    )


def test_d_of_tp1_reads_both_p_ranks_of_tp2_into_the_halves_of_its_blocks() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    side.on_work(receive(ReceiveKind.PULL, TransferMode.PULL))
    side.on_bus("", ready(1, 2))
    inc = side._by_tid[TID]
    assert inc.state is IncomingState.RECEIVING
    side.on_bus("", ready(0, 2))
    (first, second) = _legs(rec, "start_pull")
    assert (first[0], first[-1].parts) == (f"{TID}>1", (Slice(1, 2), WHOLE))
    assert (second[0], second[-1].parts) == (f"{TID}>0", (Slice(0, 2), WHOLE))
    assert side.collect([leg_event(f"{TID}>1", TransferState.DONE, Role.PULL)]) == (set(), {})
    finished, failed = side.collect([leg_event(f"{TID}>0", TransferState.DONE, Role.PULL)])
    assert finished == {"r0"} and failed == {}


def test_d_pull_whose_second_p_rank_never_readies_aborts_the_first_read_and_recomputes() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    side.on_work(receive(ReceiveKind.PULL, TransferMode.PULL))
    side.on_bus("", ready(0, 2))
    side._by_tid[TID].deadline = 0.0
    assert side.collect([]) == (set(), {})  # our READ of rank 0 is still live
    assert [a[0] for a in _legs(rec, "abort")] == [f"{TID}>0"] and rec.messages(Abort)
    finished, failed = side.collect([leg_event(f"{TID}>0", TransferState.ABORTED, Role.PULL)])
    assert finished == set() and failed == {"r0": [5, 6]}


def test_d_push_target_counts_every_writing_p_rank_before_its_blocks_go() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    side.on_work(receive(ReceiveKind.PUSH, TransferMode.PUSH))
    side.on_bus("", AbortAck(transfer_id=TID, prefill_id="p0", rank=1, tp=2))
    assert ("acknowledged", (TID, 1, 2)) in rec.calls  # P rank 1 of 2 of the two writers


def test_every_d_rank_s_announcement_that_came_before_the_request_is_kept() -> None:
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_bus("", announcement(rank=0, tp=2))
    side.on_bus("", announcement(rank=1, tp=2))
    side.on_work(work(completes=True))
    assert sorted(a[0] for a in _legs(rec, "start_push")) == [f"{TID}>0", f"{TID}>1"]


def test_a_p_request_that_ended_after_its_last_layer_still_waits_for_a_late_decode_rank() -> None:
    """P runs max_tokens=1: its request ends right after the prefill. A D rank announcing
    after that still gets its push (the blocks are held by the delayed free)."""
    rec = Recorder()
    side = streaming_to(rec, 0)
    assert side.collect({"r0"}, []) == set() and not _legs(rec, "abort")
    side.on_bus("", announcement(rank=1, tp=2))
    out = side._by_tid[TID]
    assert out.state is OutgoingState.POSTED and len(_legs(rec, "finish")) == 2
    events = [leg_event(f"{TID}>{r}", TransferState.DONE) for r in (0, 1)]
    assert side.collect(set(), events) == {"r0"} and len(rec.messages(KvPushed)) == 1


def test_a_pull_past_its_deadline_waits_for_its_target_s_own_event() -> None:
    """Pull has no legs: only the transport's quiesced event settles it, never the push
    deadline check (which would leave the target transfer behind in the engine)."""
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work([PrefillWork("r0", params(TransferMode.PULL), [0, 1], 8, True)])
    for layer in range(LAYERS):
        side.on_layer_saved(layer)
    out = side._by_tid[TID]
    assert out.state is OutgoingState.POSTED and rec.messages(KvReady)
    out.deadline = 0.0
    assert side.collect({"r0"}, []) == set() and not rec.messages(KvFailed)
    assert side.collect(set(), [event(TransferState.EXPIRED, Role.TARGET)]) == {"r0"}


def test_d_counts_each_writing_p_rank_by_its_side_channel() -> None:
    rec = Recorder()
    side, _ = decode_side(rec)
    p = TransferParams(
        transfer_id=TID, prefill_id="p0", decode_id="d0", prefill_addresses=["tcp://a", "tcp://b"]
    )
    side.on_work([DecodeWork(ReceiveKind.PUSH, "r0", p, [5, 6], 0, 8)])
    ((tid, _timeout, peer, sender_at),) = _legs(rec, "expect")
    assert (tid, peer, sender_at) == (TID, "tcp://a", {"tcp://a": 0, "tcp://b": 1})
    assert side._by_tid[TID].peers == ["tcp://a", "tcp://b"]  # both are probed if P falls silent


def test_a_pull_whose_request_ended_with_a_layer_never_computed_fails_at_once() -> None:
    """Not at the deadline: D recomputes now (a forward that raised, a hook that never ran)."""
    rec = Recorder()
    side, _ = prefill_side(rec)
    side.on_work([PrefillWork("r0", params(TransferMode.PULL), [0, 1], 8, True)])
    side.on_layer_saved(0)
    assert side._by_tid[TID].state is OutgoingState.WAITING and not rec.messages(KvReady)
    assert side.collect({"r0"}, []) == {"r0"}
    (failed,) = rec.messages(KvFailed)
    assert failed.reason is FailReason.PREFILL and not rec.messages(KvReady)
