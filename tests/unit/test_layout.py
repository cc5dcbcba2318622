"""Pool layout math: run-length helpers, run pairing, coalescing counts, indices, compat hash."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvpush.connector.layout import (
    KvRegion,
    MemType,
    PoolLayout,
    block_indices,
    check_runs,
    count_descriptors,
    dense,
    descriptor_pair,
    ids_to_runs,
    layer_index_tables,
    pair_runs,
    per_block_descs,
    pool_layout,
    registration_descs,
    runs_to_ids,
)
from kvpush.connector.peering import (
    VLLM_CPU_LAYOUT,
    VLLM_TOKEN_MAJOR_LAYOUT,
    CompatInfo,
    compat_diff,
    compat_hash,
    geometry_diff,
    paged_layout_name,
)
from kvpush.schemas.messages import PROTOCOL_VERSION, BlocksAnnounced

BB = 4096


def _layout(
    layers: int = 2, regions: int = 1, blocks: int = 16, base: int = 1 << 20, stride: int = BB
) -> PoolLayout:
    out, addr = [], base
    for _ in range(layers):
        row = []
        for _ in range(regions):
            row.append(KvRegion(base=addr, stride=stride, block_bytes=BB, num_blocks=blocks))
            addr += stride * blocks
        out.append(row)
    return PoolLayout(mem_type=MemType.DRAM, layers=out)


def test_runs_and_ids_round_trip() -> None:
    assert runs_to_ids([[3, 3], [9, 1]]).tolist() == [3, 4, 5, 9]
    assert ids_to_runs([3, 4, 5, 9]) == [(3, 3), (9, 1)]
    assert ids_to_runs([]) == [] and runs_to_ids([]).size == 0
    ids = np.array([0, 1, 2, 7, 8, 12, 5, 6])
    assert runs_to_ids(ids_to_runs(ids)).tolist() == ids.tolist()


def test_runs_reject_empty_counts_and_out_of_pool_ids() -> None:
    with pytest.raises(ValueError, match="count >= 1"):
        runs_to_ids([[3, 0]])
    with pytest.raises(ValueError, match="outside the pool"):
        check_runs([[14, 3]], 16, "remote")
    with pytest.raises(ValueError, match="twice"):
        check_runs([[2, 2], [3, 1]], 16, "local")


def test_blocks_3_4_5_9_coalesce_to_two_descriptors_per_layer() -> None:
    layout = _layout(layers=4)
    segments = pair_runs([[0, 4]], [[3, 3], [9, 1]])
    assert segments.tolist() == [[0, 3, 3], [3, 9, 1]]
    local, remote = descriptor_pair(layout, layout, range(4), segments)
    assert len(local) == len(remote) == 2 * 4
    assert count_descriptors(layout, layout, range(4), segments) == 8
    assert remote[0].tolist() == [layout.layers[0][0].base + 3 * BB, 3 * BB, 0]
    assert remote[1].tolist() == [layout.layers[0][0].base + 9 * BB, BB, 0]
    assert local[1].tolist() == [layout.layers[0][0].base + 3 * BB, BB, 0]


def test_pairing_breaks_where_either_side_breaks_and_merges_split_runs() -> None:
    segments = pair_runs([[0, 2], [10, 2]], [[5, 4]])
    assert segments.tolist() == [[0, 5, 2], [10, 7, 2]]
    assert pair_runs([[0, 1], [1, 1], [2, 2]], [[8, 4]]).tolist() == [[0, 8, 4]]
    with pytest.raises(ValueError, match="4 blocks but remote runs 3"):
        pair_runs([[0, 4]], [[0, 3]])


def test_split_k_v_regions_give_one_descriptor_per_region_per_run() -> None:
    layout = _layout(layers=3, regions=2)
    segments = pair_runs([[0, 3], [5, 1]], [[0, 3], [8, 1]])
    assert count_descriptors(layout, layout, [1], segments) == 2 * 2
    assert count_descriptors(layout, layout, range(3), segments) == 3 * 2 * 2


def test_strided_regions_fall_back_to_one_descriptor_per_block() -> None:
    dense, strided = _layout(), _layout(stride=2 * BB)
    segments = pair_runs([[0, 4]], [[4, 4]])
    assert count_descriptors(dense, dense, [0], segments) == 1
    local, remote = descriptor_pair(dense, strided, [0], segments)
    assert len(local) == 4
    assert np.diff(remote[:, 0].astype(np.int64)).tolist() == [2 * BB] * 3


def test_block_indices_address_the_same_bytes_as_the_coalesced_rows() -> None:
    layout = _layout(layers=3, regions=2, blocks=10)
    table = per_block_descs(layout)
    ids = np.array([3, 4, 5, 9])
    idx = block_indices(layout, [2, 0], ids)
    rows = table[idx]
    assert len(rows) == 2 * 2 * 4
    assert rows[0, 0] == layout.layers[2][0].base + 3 * BB
    assert rows[4, 0] == layout.layers[2][1].base + 3 * BB
    assert rows[8, 0] == layout.layers[0][0].base + 3 * BB
    assert (rows[:, 1] == BB).all()


def test_per_transfer_index_tables_match_block_indices_for_uniform_and_ragged_pools() -> None:
    one, two = _layout(layers=1, regions=1), _layout(layers=1, regions=2, base=1 << 30)
    ragged = PoolLayout(mem_type=MemType.DRAM, layers=[one.layers[0], two.layers[0]])
    ids = np.array([1, 2, 7])
    for layout in (_layout(layers=3, regions=2, blocks=10), ragged):
        tables = layer_index_tables(layout, ids)
        for layer in range(layout.num_layers):
            assert tables[layer].tolist() == block_indices(layout, [layer], ids).tolist()


def test_layout_from_numpy_arrays_registers_one_region_per_tensor() -> None:
    kv = [np.zeros((8, 2, 16, 8), np.float32) for _ in range(3)]
    layout = pool_layout([[t] for t in kv])
    region = layout.layers[0][0]
    assert (region.stride, region.block_bytes, region.num_blocks) == (1024, 1024, 8)
    assert layout.bytes_per_block == 3 * 1024
    reg = registration_descs(layout)
    assert len(reg) == 3 and int(reg[:, 1].sum()) == 3 * kv[0].nbytes


def test_adjacent_k_and_v_views_of_one_tensor_register_as_one_region() -> None:
    kv = np.zeros((2, 8, 256), np.uint8)  # [K|V, blocks, bytes]: GPU-style split layout
    layout = pool_layout([[kv[0], kv[1]]])
    assert len(layout.layers[0]) == 2
    reg = registration_descs(layout)
    assert reg.tolist() == [[kv.ctypes.data, kv.nbytes, 0]]


def test_adjacent_tensors_of_two_layers_register_as_two_regions() -> None:
    """Two layers' tensors that touch are two allocations side by side (CUDA's allocator often
    places them so): one region across them breaks CUDA IPC, which maps one allocation only."""
    buffer = np.zeros((2, 2, 8, 256), np.uint8)  # [layer, K|V, blocks, bytes], back to back
    layout = pool_layout([[buffer[0, 0], buffer[0, 1]], [buffer[1, 0], buffer[1, 1]]])
    reg = registration_descs(layout)
    layer_bytes = buffer[0].nbytes
    assert reg.tolist() == [
        [buffer.ctypes.data, layer_bytes, 0],
        [buffer.ctypes.data + layer_bytes, layer_bytes, 0],
    ]
    shared = pool_layout([[buffer[0, 0]], [buffer[0, 0]]])  # two layers sharing one tensor
    assert len(registration_descs(shared)) == 1


def test_compat_hash_covers_protocol_and_every_field() -> None:
    base = CompatInfo(model="m", dtype="float32", block_size=128, layout="NHD")
    assert base.protocol == PROTOCOL_VERSION
    variants = [
        CompatInfo(model="m2", dtype="float32", block_size=128, layout="NHD"),
        CompatInfo(model="m", dtype="float16", block_size=128, layout="NHD"),
        CompatInfo(model="m", dtype="float32", block_size=64, layout="NHD"),
        CompatInfo(model="m", dtype="float32", block_size=128, layout="HND"),
        CompatInfo(model="m", dtype="float32", block_size=128, layout="NHD", protocol=99),
    ]
    hashes = {compat_hash(v) for v in variants}
    assert compat_hash(base) not in hashes and len(hashes) == len(variants)
    assert compat_hash(base) == compat_hash(
        CompatInfo(model="m", dtype="float32", block_size=128, layout="NHD")
    )
    assert compat_diff(base, variants[1]) == ["dtype: local 'float32', peer 'float16'"]


def test_compat_hash_fits_the_bus_announcement() -> None:
    info = CompatInfo(model="m", dtype="float32", block_size=128, layout="NHD")
    message = BlocksAnnounced(
        transfer_id="tx-00000001",
        decode_id="d0",
        decode_epoch=1,
        block_runs=[(3, 3), (9, 1)],
        first_token=0,
        num_tokens=512,
        compat_hash=compat_hash(info),
        side_channel="tcp://127.0.0.1:5555",
    )
    decoded = msgspec.json.decode(msgspec.json.encode(message), type=BlocksAnnounced)
    assert decoded.compat_hash == compat_hash(info)
    assert runs_to_ids(decoded.block_runs).tolist() == [3, 4, 5, 9]


def test_geometry_diff_names_the_mismatch() -> None:
    assert geometry_diff(_layout(), _layout()) == []
    assert "bytes per block" in geometry_diff(_layout(layers=2), _layout(layers=3))[0]


def test_vllm_gpu_cache_views_are_permuted_but_each_block_is_one_dense_range() -> None:
    """vLLM's FlashAttention cache reaches the connector as a permuted view: logical
    [blocks, heads, tokens, 2*head_dim] over memory laid out [blocks, tokens, heads, ...]."""
    import torch

    memory = torch.zeros(6, 16, 2, 8)  # NHD: tokens outer in a block
    logical = memory.permute(0, 2, 1, 3)
    assert not logical[0].is_contiguous() and dense(tuple(logical[0].shape), logical[0].stride())
    (region,) = pool_layout([[logical]]).layers[0]
    assert (region.stride, region.block_bytes) == (16 * 2 * 8 * 4, 16 * 2 * 8 * 4)
    assert paged_layout_name(tuple(logical.stride())) == VLLM_TOKEN_MAJOR_LAYOUT
    cpu = torch.zeros(6, 2, 16, 8)  # vLLM CPU / HND: heads outer
    assert paged_layout_name(tuple(cpu.stride())) == VLLM_CPU_LAYOUT
    assert not dense((2, 3), (4, 1))  # rows with a gap between them
    with pytest.raises(ValueError, match="dense"):
        pool_layout([[torch.zeros(6, 4, 8)[:, :, :4]]])
