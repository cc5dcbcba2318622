"""KV pool description and the block-id -> NIXL-descriptor math.

Owns:
- ``KvRegion`` / ``PoolLayout``: where a KV pool lives (per layer, N regions, each with base
  address, block stride, bytes per block). They travel on the side channel as msgspec arrays of
  integers; NIXL descriptors are always built locally from them (NIXL's own serialized
  descriptor lists are pickles and never cross a process boundary here).
- ``Slice``: part i of n equal byte ranges of a block (what a rank exchanges with a rank of
  another TP; peering.py says which, and whether two engines may exchange blocks at all).
- block runs (``[[first_id, count], ...]``, the bus encoding) <-> ids, pairing of local and
  remote runs into segments contiguous on both sides, and descriptor building: coalesced
  ``(addr, len, dev)`` rows (one per segment per region when blocks are dense) or per-block
  indices into prepped lists (NIXL then merges adjacent rows to the same count).

Descriptor order is always layer -> region -> segment, identical on both sides, so row i of the
local list pairs with row i of the remote list. A ``Slice`` other than the whole block makes
one row per block (addresses offset into each block, length the slice's).

Threading model: none. Pure functions over frozen structs; safe from any thread.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

Runs = Sequence[Sequence[int]]


class MemType(str, enum.Enum):
    DRAM = "DRAM"  # host memory (CPU engines)
    VRAM = "VRAM"  # device memory (GPU engines)


class KvRegion(msgspec.Struct, frozen=True, array_like=True):
    """One KV tensor: block ``i`` spans ``[base + i*stride, base + i*stride + block_bytes)``."""

    base: int
    stride: int
    block_bytes: int
    num_blocks: int
    device: int = 0

    @property
    def span_bytes(self) -> int:
        return self.stride * (self.num_blocks - 1) + self.block_bytes

    @property
    def dense(self) -> bool:
        """Consecutive blocks touch, so a run of ids is one contiguous byte range."""
        return self.stride == self.block_bytes


class PoolLayout(msgspec.Struct, frozen=True):
    """A KV pool: ``layers[l]`` lists that layer's regions (1 for vLLM CPU, 2 for split K/V)."""

    mem_type: MemType
    layers: list[list[KvRegion]]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return min(r.num_blocks for regions in self.layers for r in regions)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id owns across all layers and regions."""
        return sum(r.block_bytes for regions in self.layers for r in regions)

    def layer_bytes(self, layers: Iterable[int]) -> int:
        return sum(r.block_bytes for layer in layers for r in self.layers[layer])

    def geometry(self) -> list[list[int]]:
        """Bytes per block of every region: two pools can exchange blocks iff these match."""
        return [[r.block_bytes for r in regions] for regions in self.layers]

    def prepped_size(self) -> int:
        """Rows of a per-block prepped descriptor list covering the whole pool."""
        return sum(r.num_blocks for regions in self.layers for r in regions)


class Slice(msgspec.Struct, frozen=True, array_like=True):
    """Part ``index`` of ``parts`` equal byte ranges of every block (``Slice()``: all of it)."""

    index: int = 0
    parts: int = 1

    @property
    def whole(self) -> bool:
        return self.parts == 1

    def bounds(self, block_bytes: int) -> tuple[int, int]:
        """(offset, length) of this slice inside a block of ``block_bytes``."""
        length = block_bytes // self.parts
        return self.index * length, length


WHOLE = Slice()


# ---- building a layout from arrays ----------------------------------------------------------


def region_of(tensor: Any) -> tuple[KvRegion, MemType]:
    """Describe a numpy array or torch tensor shaped ``[num_blocks, ...]`` (each block dense)."""
    if isinstance(tensor, np.ndarray):
        if tensor.ndim < 1 or not tensor[0].flags.c_contiguous:
            raise ValueError("a KV array must be [num_blocks, ...] with each block C-contiguous")
        region = KvRegion(
            base=int(tensor.ctypes.data),
            stride=int(tensor.strides[0]),
            block_bytes=int(tensor[0].nbytes),
            num_blocks=int(tensor.shape[0]),
        )
        return region, MemType.DRAM
    if hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size"):  # torch.Tensor
        if tensor.dim() < 1 or not dense(tuple(tensor[0].shape), tuple(tensor[0].stride())):
            raise ValueError("a KV tensor must be [num_blocks, ...] with each block dense")
        size = tensor.element_size()
        cuda = tensor.device.type == "cuda"
        region = KvRegion(
            base=int(tensor.data_ptr()),
            stride=int(tensor.stride(0)) * size,
            block_bytes=int(tensor[0].numel()) * size,
            num_blocks=int(tensor.shape[0]),
            device=int(tensor.device.index or 0) if cuda else 0,
        )
        return region, MemType.VRAM if cuda else MemType.DRAM
    raise TypeError(f"cannot describe a {type(tensor).__name__} as a KV region")


def dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Do elements of this shape and these strides (in elements) fill one gap-free byte range,
    in some dimension order? (vLLM's GPU cache is a permuted view: each block is dense although
    ``is_contiguous()`` is False.)"""
    dims = sorted((st, n) for n, st in zip(shape, strides, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def pool_layout(layers: Sequence[Sequence[Any]]) -> PoolLayout:
    """A layout from per-layer lists of tensors (e.g. ``[[kv0], [kv1]]`` or ``[[k0, v0], ...]``)."""
    if not layers or any(not regions for regions in layers):
        raise ValueError("a KV pool needs at least one layer and one tensor per layer")
    described = [[region_of(t) for t in regions] for regions in layers]
    mem_types = {mem for regions in described for _, mem in regions}
    if len(mem_types) != 1:
        raise ValueError("all KV tensors of one pool must live in the same memory type")
    return PoolLayout(
        mem_type=mem_types.pop(), layers=[[r for r, _ in regions] for regions in described]
    )


def registration_descs(layout: PoolLayout) -> np.ndarray:
    """``(addr, len, dev)`` rows to register: one per tensor. Overlapping spans merge (layers
    that share a tensor), and so do the touching spans of one layer (its K and V views of one
    tensor); touching spans of two layers do not: they are two allocations that happen to be
    adjacent, and a region across them breaks CUDA IPC, which maps only the allocation its start
    lies in (UCX ``cuda_ipc``: ``cuMemcpyDtoDAsync ... invalid argument`` past it)."""
    spans = sorted(
        (r.device, r.base, r.base + r.span_bytes, layer)
        for layer, regions in enumerate(layout.layers)
        for r in regions
    )
    merged: list[list[int]] = []  # [dev, start, end, layers...]
    for dev, start, end, layer in spans:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0] == dev
            and (start < last[2] or (start == last[2] and layer in last[3:]))
        ):
            last[2] = max(last[2], end)
            last.append(layer)
        else:
            merged.append([dev, start, end, layer])
    return np.array([[m[1], m[2] - m[1], m[0]] for m in merged], dtype=np.uint64).reshape(-1, 3)


# ---- block runs -----------------------------------------------------------------------------


def runs_to_ids(runs: Runs) -> np.ndarray:
    """``[[3, 3], [9, 1]]`` -> ``[3, 4, 5, 9]``."""
    if len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    if len(runs) == 1 and int(runs[0][1]) >= 1 and int(runs[0][0]) >= 0:
        return np.arange(int(runs[0][0]), int(runs[0][0]) + int(runs[0][1]), dtype=np.int64)
    arr = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    firsts, counts = arr[:, 0], arr[:, 1]
    if (counts < 1).any() or (firsts < 0).any():
        raise ValueError("block runs need first >= 0 and count >= 1")
    starts = np.repeat(firsts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return starts + np.arange(int(counts.sum()), dtype=np.int64)


def ids_to_runs(ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """``[3, 4, 5, 9]`` -> ``[(3, 3), (9, 1)]``: ascending consecutive ids become one run."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [arr.size])))
    return [(int(arr[s]), int(c)) for s, c in zip(starts, counts, strict=True)]


def check_runs(runs: Runs, num_blocks: int, side: str) -> None:
    """Raise ``ValueError`` if a run leaves ``[0, num_blocks)`` or runs overlap."""
    spans = sorted((int(first), int(count)) for first, count in runs)
    end = 0
    for first, count in spans:
        if count < 1 or first < 0:
            raise ValueError("block runs need first >= 0 and count >= 1")
        if first < end:
            raise ValueError(f"{side} block runs name a block twice")
        end = first + count
    if end > num_blocks:
        raise ValueError(f"{side} block id {end - 1} is outside the pool (0..{num_blocks - 1})")


def pair_runs(local_runs: Runs, remote_runs: Runs) -> np.ndarray:
    """Segments ``[local_first, remote_first, count]`` contiguous on both sides, maximal.

    ``local_runs`` and ``remote_runs`` cover the same tokens in order, so they must hold the
    same number of blocks; block ``k`` of the local sequence pairs with block ``k`` remotely.
    Pure Python on purpose: run lists are short and numpy's per-call cost would dominate.
    """
    lruns = [(int(f), int(c)) for f, c in local_runs]
    rruns = [(int(f), int(c)) for f, c in remote_runs]
    if any(c < 1 or f < 0 for f, c in lruns + rruns):
        raise ValueError("block runs need first >= 0 and count >= 1")
    ltotal, rtotal = sum(c for _, c in lruns), sum(c for _, c in rruns)
    if ltotal != rtotal:
        raise ValueError(f"local runs hold {ltotal} blocks but remote runs {rtotal}")
    segments: list[list[int]] = []
    li = ri = loff = roff = 0
    while li < len(lruns):
        (lf, lc), (rf, rc) = lruns[li], rruns[ri]
        n = min(lc - loff, rc - roff)
        a, b = lf + loff, rf + roff
        last = segments[-1] if segments else None
        if last is not None and last[0] + last[2] == a and last[1] + last[2] == b:
            last[2] += n
        else:
            segments.append([a, b, n])
        loff, roff = loff + n, roff + n
        if loff == lc:
            li, loff = li + 1, 0
        if roff == rc:
            ri, roff = ri + 1, 0
    return np.array(segments, dtype=np.int64).reshape(-1, 3)


def segment_ids(segments: np.ndarray, column: int) -> np.ndarray:
    """Expand one side (0 = local, 1 = remote) of ``pair_runs`` segments back to block ids."""
    return runs_to_ids(segments[:, [column, 2]]) if len(segments) else np.zeros(0, np.int64)


# ---- descriptors ----------------------------------------------------------------------------


def _rows(
    region: KvRegion, firsts: np.ndarray, counts: np.ndarray, dense: bool, part: Slice = WHOLE
) -> np.ndarray:
    if not dense:  # one row per block
        ids = runs_to_ids(np.stack([firsts, counts], axis=1))
        firsts, counts = ids, np.ones_like(ids)
    offset, length = part.bounds(region.block_bytes)
    out = np.empty((firsts.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(region.base + offset) + firsts.astype(np.uint64) * np.uint64(
        region.stride
    )
    out[:, 1] = counts.astype(np.uint64) * np.uint64(length)
    out[:, 2] = region.device
    return out


def descriptor_pair(
    local: PoolLayout,
    remote: PoolLayout,
    layers: Sequence[int],
    segments: np.ndarray,
    parts: tuple[Slice, Slice] = (WHOLE, WHOLE),
) -> tuple[np.ndarray, np.ndarray]:
    """Coalesced ``(addr, len, dev)`` rows for ``layers``: local side and remote side, aligned.

    A segment is one row per region when both regions are dense and both ``parts`` (local,
    remote) are whole blocks, else one row per block.
    """
    lrows: list[np.ndarray] = []
    rrows: list[np.ndarray] = []
    whole = parts[0].whole and parts[1].whole
    for layer in layers:
        for lreg, rreg in zip(local.layers[layer], remote.layers[layer], strict=True):
            dense = lreg.dense and rreg.dense and whole
            lrows.append(_rows(lreg, segments[:, 0], segments[:, 2], dense, parts[0]))
            rrows.append(_rows(rreg, segments[:, 1], segments[:, 2], dense, parts[1]))
    empty = np.zeros((0, 3), dtype=np.uint64)
    return (np.concatenate(lrows) if lrows else empty, np.concatenate(rrows) if rrows else empty)


def count_descriptors(
    local: PoolLayout,
    remote: PoolLayout,
    layers: Sequence[int],
    segments: np.ndarray,
    parts: tuple[Slice, Slice] = (WHOLE, WHOLE),
) -> int:
    """Rows ``descriptor_pair`` would build (also what NIXL merges prepped indices down to)."""
    blocks = int(segments[:, 2].sum()) if len(segments) else 0
    whole = parts[0].whole and parts[1].whole
    total = 0
    for layer in layers:
        for lreg, rreg in zip(local.layers[layer], remote.layers[layer], strict=True):
            total += len(segments) if (lreg.dense and rreg.dense and whole) else blocks
    return total


def per_block_descs(layout: PoolLayout) -> np.ndarray:
    """Every block of every region as one row, ordered layer -> region -> block id."""
    rows = [
        _rows(r, np.arange(r.num_blocks, dtype=np.int64), np.ones(r.num_blocks, np.int64), True)
        for regions in layout.layers
        for r in regions
    ]
    return np.concatenate(rows)


def block_indices(layout: PoolLayout, layers: Sequence[int], ids: np.ndarray) -> np.ndarray:
    """Row indices into ``per_block_descs(layout)`` for ``ids`` of ``layers`` (int32, ordered)."""
    offsets = np.cumsum([0] + [r.num_blocks for regions in layout.layers for r in regions])
    per_layer = [len(regions) for regions in layout.layers]
    first_region = np.cumsum([0, *per_layer])
    parts = [
        offsets[first_region[layer] + k] + ids for layer in layers for k in range(per_layer[layer])
    ]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def layer_index_tables(layout: PoolLayout, ids: np.ndarray) -> list[np.ndarray]:
    """Per layer, the ``block_indices`` of ``ids`` (all regions): computed once per transfer so
    that posting a layer group is a slice, not index arithmetic."""
    counts = [r.num_blocks for regions in layout.layers for r in regions]
    starts = np.cumsum([0, *counts[:-1]], dtype=np.int64)
    table = (starts[:, None] + ids[None, :]).astype(np.int32)  # [layer*region, block]
    bounds = np.cumsum([0, *(len(regions) for regions in layout.layers)])
    return [table[a:b].reshape(-1) for a, b in itertools.pairwise(bounds)]  # views of ``table``
