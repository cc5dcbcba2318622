"""TP mapping between engines of different tensor parallelism: which slice of a block a rank
pair exchanges, which pools may meet at all, and the descriptors a sliced transfer posts.

The bytes are checked with numpy: a P of TP 2 writing each rank's whole block into its half of a
D block of TP 1 (and the reverse) must produce exactly the head-merged (head-split) block.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.connector.engine import TransferEngine
from kvpush.connector.layout import (
    WHOLE,
    Slice,
    count_descriptors,
    descriptor_pair,
    pair_runs,
    pool_layout,
)
from kvpush.connector.peering import (
    VLLM_CPU_LAYOUT,
    TpMismatch,
    geometry_diff,
    peer_ranks,
    slice_diff,
    tp_slices,
)
from kvpush.connector.transfer import (
    NOTICE_VERSION,
    Notice,
    NoticeKind,
    Role,
    Transfer,
    TransferState,
    notice_decoder,
    notice_encoder,
)

HEADS, BLOCKS, TOKENS, HEAD_DIM = 4, 6, 8, 4


@pytest.mark.parametrize(
    ("mine", "peer", "expected"),
    [
        ((0, 1), (0, 1), (WHOLE, WHOLE)),
        ((1, 2), (1, 2), (WHOLE, WHOLE)),
        ((1, 2), (0, 1), (WHOLE, Slice(1, 2))),  # P rank 1 of 2 -> second half of D's block
        ((0, 1), (1, 2), (Slice(1, 2), WHOLE)),  # D of 1 reads P rank 1's block into its half
        ((0, 1), (3, 4), (Slice(3, 4), WHOLE)),
        ((1, 2), (3, 4), (Slice(1, 2), WHOLE)),  # rank 1 of 2 holds heads of ranks 2 and 3 of 4
        ((3, 4), (1, 2), (WHOLE, Slice(1, 2))),
    ],
)
def test_rank_pairs_exchange_the_slices_that_hold_their_common_heads(
    mine: tuple[int, int], peer: tuple[int, int], expected: tuple[Slice, Slice]
) -> None:
    assert tp_slices(*mine, *peer, VLLM_CPU_LAYOUT) == expected


@pytest.mark.parametrize(
    ("mine", "peer", "layout", "why"),
    [
        ((0, 2), (0, 3), VLLM_CPU_LAYOUT, "one must divide the other"),
        ((0, 2), (1, 2), VLLM_CPU_LAYOUT, "does not pair"),
        ((0, 2), (2, 4), VLLM_CPU_LAYOUT, "holds no heads"),
        ((1, 2), (0, 1), "flash-NHD", "does not keep a block's KV heads contiguous"),
    ],
)
def test_rank_pairs_that_cannot_map_are_refused_with_the_reason(
    mine: tuple[int, int], peer: tuple[int, int], layout: str, why: str
) -> None:
    with pytest.raises(TpMismatch, match=why):
        tp_slices(*mine, *peer, layout)


def test_peer_ranks_are_the_ranks_holding_our_heads() -> None:
    assert peer_ranks(0, 1, 2) == [0, 1]
    assert peer_ranks(1, 2, 1) == [0]
    assert peer_ranks(1, 2, 4) == [2, 3]
    assert peer_ranks(3, 4, 2) == [1]
    assert peer_ranks(1, 2, 2) == [1]


def _pool(heads: int, seed: int = 0, layers: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (BLOCKS, heads, TOKENS, 2 * HEAD_DIM)  # vLLM CPU: one tensor per layer
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(layers)]


def _copy(lrows: np.ndarray, rrows: np.ndarray) -> None:
    """What NIXL would do for a WRITE of ``lrows`` into ``rrows`` (both in this process)."""
    for (src, n, _), (dst, m, _) in zip(lrows.tolist(), rrows.tolist(), strict=True):
        assert n == m
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * m).from_address(dst))[:] = (
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(src))
        )


def test_two_p_ranks_writing_whole_blocks_into_halves_build_d_s_merged_block() -> None:
    """P of TP 2 (two heads each) -> D of TP 1 (four heads), blocks 1,2 -> D blocks 3,4."""
    p_ranks = [_pool(HEADS // 2), _pool(HEADS // 2, seed=1)]
    d = [np.zeros_like(np.concatenate([p_ranks[0][0], p_ranks[1][0]], axis=1)) for _ in range(2)]
    d_layout = pool_layout([[t] for t in d])
    segments = pair_runs([(1, 2)], [(3, 2)])
    for rank, pool in enumerate(p_ranks):
        p_layout = pool_layout([[t] for t in pool])
        parts = tp_slices(rank, 2, 0, 1, VLLM_CPU_LAYOUT)
        assert geometry_diff(p_layout, d_layout) == []
        assert slice_diff(p_layout, d_layout, *parts) == []
        lrows, rrows = descriptor_pair(p_layout, d_layout, [0, 1], segments, parts)
        assert len(lrows) == count_descriptors(p_layout, d_layout, [0, 1], segments, parts) == 4
        _copy(lrows, rrows)
    for layer in range(2):
        merged = np.concatenate([p_ranks[0][layer][1:3], p_ranks[1][layer][1:3]], axis=1)
        np.testing.assert_array_equal(d[layer][3:5], merged)
        assert not d[layer][:3].any() and not d[layer][5:].any()  # nothing else was touched


def test_one_p_block_split_in_halves_builds_each_d_rank_s_block() -> None:
    """P of TP 1 (four heads) -> D of TP 2 (two heads per rank)."""
    p = _pool(HEADS)
    p_layout = pool_layout([[t] for t in p])
    segments = pair_runs([(0, 3)], [(2, 3)])
    for rank in range(2):
        d = [np.zeros((BLOCKS, HEADS // 2, TOKENS, 2 * HEAD_DIM), np.float32) for _ in range(2)]
        d_layout = pool_layout([[t] for t in d])
        parts = tp_slices(0, 1, rank, 2, VLLM_CPU_LAYOUT)
        lrows, rrows = descriptor_pair(p_layout, d_layout, [0, 1], segments, parts)
        _copy(lrows, rrows)
        heads = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
        for layer in range(2):
            np.testing.assert_array_equal(d[layer][2:5], p[layer][0:3, heads])


def test_pools_whose_blocks_do_not_scale_by_one_ratio_cannot_meet() -> None:
    two, four = pool_layout([[t] for t in _pool(2)]), pool_layout([[t] for t in _pool(4)])
    assert geometry_diff(two, four) == [] and geometry_diff(four, two) == []
    three = pool_layout([[t] for t in _pool(3)])
    assert "bytes per block" in geometry_diff(two, three)[0]
    mixed = pool_layout([[_pool(2)[0]], [_pool(4)[0]]])  # layer 0 halves, layer 1 not
    assert "bytes per block" in geometry_diff(two, mixed)[0]
    # replicated heads (vLLM at TP > kv heads): same bytes per block, halves do not match
    assert "do not match" in slice_diff(two, two, WHOLE, Slice(1, 2))[0]


def _target() -> Transfer:
    return Transfer(transfer_id="t", role=Role.TARGET, peer=None, created=0.0, deadline=9.0)


def test_a_target_written_by_two_p_ranks_is_done_only_with_both_notices() -> None:
    t = _target()
    t.on_notice(NoticeKind.DONE, 1.0, sender=1, senders=2)
    assert t.state is TransferState.WAITING_PEER and not t.quiesced
    t.on_notice(NoticeKind.DONE, 1.0, sender=1, senders=2)  # a repeat counts once
    assert t.state is TransferState.WAITING_PEER
    t.on_notice(NoticeKind.DONE, 2.0, sender=0, senders=2)
    assert t.state is TransferState.DONE and t.quiesced


def test_one_sender_s_failure_ends_the_target_at_once_but_quiesces_it_with_the_last() -> None:
    """docs/design.md, correctness rule 3 per rank: the blocks may go only when no sibling can
    still write."""
    t = _target()
    t.on_notice(NoticeKind.FAILED, 1.0, sender=0, senders=2)
    assert t.state is TransferState.FAILED and not t.quiesced
    t.on_notice(NoticeKind.DONE, 2.0, sender=1, senders=2)
    assert t.state is TransferState.FAILED and t.quiesced


def test_a_notice_names_the_target_s_id_its_sender_rank_and_the_sender_count() -> None:
    notice = Notice(NOTICE_VERSION, NoticeKind.DONE, "tx-1", 1, 2)
    assert notice_encoder.encode(notice) == b'[1,"done","tx-1",1,2]'
    assert notice_decoder.decode(b'[1,"done","tx-1"]') == Notice(1, NoticeKind.DONE, "tx-1", 0, 1)


def test_a_lost_writer_of_two_is_that_rank_s_last_word_not_the_target_s() -> None:
    """P of TP 2 writes into D of TP 1: one P rank's death must not free D's blocks while the
    other can still write."""
    layout = pool_layout([[t] for t in _pool(2)])
    engine = TransferEngine(
        None,  # type: ignore[arg-type]  (no NIXL call on these paths)
        layout,
        None,
        cancel_grace_s=1.0,
        max_transfers=8,
        max_early_notices=8,
        clock=lambda: 1.0,
    )
    t = engine.expect("t", 5.0, "tcp://a", {"tcp://a": 0, "tcp://b": 1})
    engine.detach("tcp://a", "peer lost")
    assert t.state is TransferState.FAILED and not t.quiesced
    engine.detach("tcp://b", "peer lost")
    assert t.quiesced
