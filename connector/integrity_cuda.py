"""The KV checksum's block sums on CUDA in one Triton kernel: ``integrity.KvSums``'s fast path.

On an H200 the torch path (a gather and a reduction per region, 2048 tokens of an 8B shape)
cost ~60 us of host time and ~33 us of GPU time per layer, mostly launches and a second pass
over the gathered copy. This kernel reads each block's bytes once, straight from the registered
regions (a device table of their base addresses and strides, built and compiled once, at
registration), and writes one partial sum per chunk of each block part; summing the chunks
gives the torch path's numbers exactly (integer sums: any order gives the same value). P
and D each launch it once for every layer of a transfer.

Threading model: none of its own; launches run on the caller's current CUDA stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kvpush.connector.layout import KvRegion

CHUNK = 4096  # elements one program sums


@triton.jit(do_not_specialize=["first_region", "n", "parts", "part_elems", "chunks"])
def _partial_sums(
    bases,  # int64 [regions]: each region's base address
    strides,  # int64 [regions]: its block stride, in elements
    ids,  # int64 [n]: the blocks, in transfer order
    out,  # int64 [regions_in_call, n, parts, chunks]
    first_region,
    n,
    parts,
    part_elems,
    chunks,
    WIDTH: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid % chunks
    rest = pid // chunks
    part = rest % parts
    rest = rest // parts
    k = rest % n
    region = first_region + rest // n
    base = tl.load(bases + region)
    stride = tl.load(strides + region)
    block = tl.load(ids + k)
    if WIDTH == 1:
        ptr = base.to(tl.pointer_type(tl.int8), bitcast=True)
    elif WIDTH == 2:
        ptr = base.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        ptr = base.to(tl.pointer_type(tl.int32), bitcast=True)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(
        ptr + block * stride + part * part_elems + offs, mask=offs < part_elems, other=0
    )
    tl.store(out + pid, tl.sum(values.to(tl.int64), axis=0))


class RegionTable:
    """Every region of a pool on one device, for ``_partial_sums``."""

    def __init__(self, regions: Sequence[KvRegion], width: int, parts: int, device: Any) -> None:
        elems = {r.block_bytes // width for r in regions}
        if len(elems) != 1 or width not in (1, 2, 4) or next(iter(elems)) % parts:
            raise ValueError("regions of different block sizes: no table")
        self.width = width
        self.parts = parts
        self.part_elems = next(iter(elems)) // parts
        self.chunks = -(-self.part_elems // CHUNK)
        self.bases = torch.tensor([r.base for r in regions], dtype=torch.int64, device=device)
        self.strides = torch.tensor(
            [r.stride // width for r in regions], dtype=torch.int64, device=device
        )
        # compile now, not in the first transfer (the sizes are not specialised on: one build)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        self.fill(
            torch.empty((1, 1, parts, self.chunks), dtype=torch.int64, device=device), 0, 1, index
        )
        torch.cuda.synchronize(device)

    def fill(self, out: Any, first_region: int, regions: int, index: Any) -> None:
        """Partial sums of ``regions`` regions from ``first_region`` on, rows ``index``, into
        ``out`` (contiguous int64 ``[regions, n, parts, chunks]``)."""
        n = int(index.numel())
        grid = (regions * n * self.parts * self.chunks,)
        _partial_sums[grid](
            self.bases,
            self.strides,
            index,
            out,
            first_region,
            n,
            self.parts,
            self.part_elems,
            self.chunks,
            WIDTH=self.width,
            CHUNK=CHUNK,
        )
