"""KV integrity: the checksum of the KV a transfer moves, computed where the KV lives.

The definition, the same on both sides of a transfer. For the ``n`` blocks ``b_0..b_{n-1}`` it
moves (token order), the slice ``part`` of each block it moves, and the pool's layers ``l`` with
their ``R`` regions ``r`` each (``PoolLayout`` order: what the NIXL descriptors are built from)::

    checksum = sum over l, r, k of ((l*R + r)*n + k + 1) * S(l, r, b_k)    (wrap-around int64)

``S`` is the sum of the slice's bytes read as signed integers of the KV element's width
(bf16/fp16: int16, fp32: int32, 8-bit: int8). Integer sums are exact and need no order, so any
device and any reduction give the same value; one changed byte changes ``S`` of its block, and a
block swapped or written to the wrong place meets another weight.

How: ``KvSums`` reduces a request's blocks of every registered region (base, stride, bytes per
block: what the descriptors cover) to per-block sums of ``g`` equal byte parts, int64, on the
KV's device (``g``: the KV heads of a head-major layout, else 1; a rank of another TP moves a
slice that is a run of parts): on CUDA one Triton kernel reads each block once
(integrity_cuda.py), else torch ops over integer row views of the tensor's own memory (no
copy). Only these small sums reach the host, once per transfer; the weighting (``checksum``,
``part_checksums``) is the same numpy code on both sides.

- P (``SourceSums``): once ``save_kv_layer`` saw the last layer, every layer's sums in one
  pass (the blocks do not change until the transfer ends); on CUDA one kernel on the side
  stream, after an event of the forward's stream (the forward's layers run no work of theirs),
  then one non-blocking copy to pinned memory, read when the done notice (or KvReady) is sent:
  a push's notice waits for them on the transport's poller (``transfer.LateChecksum``), so the
  forward's logits and sampling (P's first token) do not.
- D (``KvSums.all_layers``): the landed blocks' sums, on CUDA on a side stream, read before the
  receive is reported to vLLM.

Also here: ``Outcome`` (what verifying a receive concluded) and ``IntegrityCounts`` (a worker
half's outcomes and stale words, taken with each step's output).

Threading model: ``KvSums`` holds no mutable state but its side stream (D calls ``all_layers``
from one thread, the engine's); a ``SourceSums`` is filled on the forward thread; after its last
layer a push's done notice reads it under the transport's lock (``ready``, then ``value``: on the
poller, or the thread that calls ``finish``), a pull's KvReady under the prefill side's lock.
``IntegrityCounts`` is safe from any thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import numpy as np

from kvpush.connector.layout import WHOLE, KvRegion, PoolLayout, Slice

log = logging.getLogger(__name__)
INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_WRAP = 2**64


class Outcome(str, enum.Enum):
    """What verifying one receive concluded (per request: the worst of its parts)."""

    OFF = "off"  # this worker computes no checksum (--kv-checksum off)
    VERIFIED = "verified"  # both sides computed it and they agree
    UNCHECKED = "unchecked"  # landed without a checksum to compare (counted, not trusted)
    MISMATCH = "mismatch"  # they differ: decode computed the prompt itself


STALE = "stale"  # a count: a notice or bus word of another allocation, dropped
_ORDER = (Outcome.OFF, Outcome.VERIFIED, Outcome.UNCHECKED, Outcome.MISMATCH)


def worst(a: Outcome, b: Outcome) -> Outcome:
    return a if _ORDER.index(a) >= _ORDER.index(b) else b


class IntegrityCounts:
    """Outcomes (and stale words) since the last ``take``, with each request's outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._outcomes: dict[str, str] = {}

    def record(self, req_id: str, outcome: Outcome) -> None:
        with self._lock:
            self._counts[outcome.value] += 1
            self._outcomes[req_id] = outcome.value

    def stale(self, count: int = 1) -> None:
        with self._lock:
            self._counts[STALE] += count

    def take(self) -> tuple[dict[str, int], dict[str, str]]:
        with self._lock:
            counts, outcomes = dict(self._counts), self._outcomes
            self._counts, self._outcomes = Counter(), {}
        return counts, outcomes


# ---- the weighting (host, numpy) ------------------------------------------------------------


def wrap(value: int) -> int:
    """``value`` as a wrap-around int64."""
    return (value + 2**63) % _WRAP - 2**63


def part_columns(part: Slice, parts: int) -> slice | None:
    """The columns of ``parts`` equal parts that slice ``part`` of a block covers (None: it
    does not fall on their bounds)."""
    if parts % part.parts:
        return None
    per = parts // part.parts
    return slice(part.index * per, (part.index + 1) * per)


def _weighted(sums: np.ndarray) -> int:
    """sum((flat index + 1) * sums) over ``[L, R, n]`` block sums: the checksum's weighting."""
    weights = np.arange(1, sums.size + 1, dtype=np.int64).reshape(sums.shape)
    with np.errstate(over="ignore"):
        return int((np.asarray(sums, dtype=np.int64) * weights).sum(dtype=np.int64))


def checksum(sums: np.ndarray, first: int = 0, part: Slice = WHOLE) -> int | None:
    """The checksum of blocks ``[first:]`` of ``sums`` (``[L, R, blocks, parts]``, from
    ``KvSums``), slice ``part`` of each; None when ``part`` does not fall on part bounds."""
    cols = part_columns(part, sums.shape[-1])
    if cols is None:
        return None
    with np.errstate(over="ignore"):
        return _weighted(sums[:, :, first:, cols].sum(axis=-1, dtype=np.int64))


def part_checksums(sums: np.ndarray) -> list[int]:
    """One checksum per equal part of a block, over every block of ``sums`` (KvReady's)."""
    return [_weighted(sums[..., j]) for j in range(sums.shape[-1])]


def from_parts(checksums: Sequence[int], part: Slice) -> int | None:
    """The checksum of slice ``part`` from ``part_checksums`` (None: not on part bounds)."""
    cols = part_columns(part, len(checksums))
    return None if cols is None else wrap(sum(checksums[cols]))


# ---- the sums (torch, on the KV's device) ---------------------------------------------------


class Pending:
    """Block sums on their way to the host: ``value`` once the copy ran (waits if not yet).

    ``on_device`` (CUDA): a context manager that makes the KV's GPU the calling thread's
    current device. ``ready`` and ``value`` run on threads vLLM never set a device on (the
    transport's poller, the gate); without it the CUDA runtime's first call there binds the
    thread to GPU 0, and a TP rank on another GPU would open a context on GPU 0."""

    def __init__(
        self,
        host: Any,
        event: Any = None,
        on_device: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self._host = host
        self._event = event
        self._on_device = on_device

    def ready(self) -> bool:
        """Are they on the host (``value`` would not wait)?"""
        event = self._event  # read once: ``value`` clears it
        if event is None:
            return True
        with self._on_device():
            return bool(event.query())

    def value(self) -> np.ndarray:
        if self._event is not None:
            with self._on_device():
                self._event.synchronize()
            self._event = None
        return self._host.numpy()


class KvSums:
    """Per-block sums of a KV pool's registered regions (see the module docstring). On CUDA
    with Triton one kernel reads the blocks (integrity_cuda.py), else torch ops per region;
    both give the same integers. ``fast=False``: torch ops always."""

    def __init__(
        self,
        layout: PoolLayout,
        tensors: Sequence[Sequence[Any]],
        parts: int = 1,
        fast: bool = True,
    ) -> None:
        import torch

        self._torch = torch
        self.num_layers = layout.num_layers
        self.regions = len(layout.layers[0])
        self.parts = parts
        if any(len(regions) != self.regions for regions in layout.layers):
            raise ValueError("every layer of a KV pool needs the same number of regions")
        self.views = [
            [int_rows(tensor, region) for tensor, region in zip(ts, regions, strict=True)]
            for ts, regions in zip(tensors, layout.layers, strict=True)
        ]
        if any(view.shape[1] % parts for views in self.views for view in views):
            raise ValueError(f"a KV block does not split into {parts} equal parts")
        self.device = self.views[0][0].device
        cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._table: Any = None
        if cuda and fast:
            try:
                from kvpush.connector.integrity_cuda import RegionTable

                width = self.views[0][0].element_size()
                every = [r for regions in layout.layers for r in regions]
                self._table = RegionTable(every, width, parts, self.device)
            except (ImportError, ValueError) as exc:  # torch ops then: slower, the same sums
                log.info("kvpush KV checksum: no Triton kernel (%s), torch ops", exc)
        self.chunks = self._table.chunks if self._table is not None else 1
        if cuda:  # the side stream, pinned buffers, the kernel: ready before the first receive
            self.all_layers([0])

    @property
    def kernel(self) -> str:
        """What takes the sums: ``triton`` (integrity_cuda.py) or ``torch`` (ops per region)."""
        return "triton" if self._table is not None else "torch"

    @property
    def side_stream(self) -> Any:
        """The CUDA stream the sums run on beside the forward's (None off CUDA)."""
        return self._side

    @property
    def torch(self) -> Any:
        return self._torch

    def index(self, ids: Sequence[int]) -> Any:
        """Block ids as an index tensor on the KV's device (copied without a host sync)."""
        index = self._torch.tensor(list(ids), dtype=self._torch.long)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def buffer(self, n: int) -> Any:
        """Room for the sums of ``n`` blocks: int64 ``[L, R, n, parts, chunks]`` on the KV's
        device (``fill`` writes it, ``to_host`` adds up the chunks)."""
        shape = (self.num_layers, self.regions, n, self.parts, self.chunks)
        return self._torch.empty(shape, dtype=self._torch.int64, device=self.device)

    def fill(self, out: Any, layer: int, index: Any) -> None:
        """``layer``'s sums of rows ``index`` into ``out[layer]``, on the current stream, with
        torch ops (the Triton kernel fills every layer at once: ``pending_sums``)."""
        for region, view in enumerate(self.views[layer]):
            rows = view.index_select(0, index).view(len(index), self.parts, -1)
            out[layer, region, :, :, 0] = rows.sum(-1, dtype=self._torch.int64)

    def to_host(self, out: Any) -> Pending:
        """``out``'s sums as ``[L, R, n, parts]`` on the host (CUDA: a pinned copy, no host
        sync; ``Pending.value`` waits for it)."""
        sums = out.sum(-1) if self.chunks > 1 else out[..., 0]
        if self.device.type != "cuda":
            return Pending(sums)
        host = self._torch.empty(sums.shape, dtype=self._torch.int64, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = self._torch.cuda.Event()
        event.record()
        return Pending(host, event, partial(self._torch.cuda.device, self.device))

    def all_layers(self, ids: Sequence[int]) -> np.ndarray:
        """``[L, R, n, parts]`` sums of blocks ``ids`` now (D: what landed); on CUDA on a side
        stream, so it waits for nothing but itself."""
        if self._side is None:
            return self.pending_sums(ids).value()
        with self._torch.cuda.stream(self._side):
            pending = self.pending_sums(ids)
        return pending.value()

    def pending_sums(self, ids: Sequence[int]) -> Pending:
        """The sums of every layer of blocks ``ids``, queued on the current stream (CUDA: one
        launch, then a pinned copy; ``Pending.value`` waits for it)."""
        index, out = self.index(ids), self.buffer(len(ids))
        if self._table is not None:  # one launch for every layer
            self._table.fill(out, 0, self.num_layers * self.regions, index)
        else:
            for layer in range(self.num_layers):
                self.fill(out, layer, index)
        return self.to_host(out)


class SourceSums:
    """P: the block sums of one request's blocks, taken in one pass once its last layer is
    computed (``add`` counts the layers in), on the host after that (``value``; ``ready``
    says whether it would wait)."""

    def __init__(self, kv: KvSums, block_ids: Sequence[int]) -> None:
        self._kv = kv
        self.ids = list(block_ids)
        self._added: set[int] = set()
        self._pending: Pending | None = None

    def add(self, layer: int) -> None:
        """``layer`` is computed (called on the forward's thread once its KV is queued). With
        the last layer in, every layer's sums are queued at once: on CUDA one kernel on the side
        stream, after an event of the forward's stream; the forward's layers run no work of
        theirs (every layer of a 2048-token prompt of the 8B shape: 256 MiB to read, after the
        last layer). A push's done notice waits for them (the transport polls ``ready``), not
        the forward: its logits and sampling run meanwhile. A pull's KvReady reads ``value`` on
        the gate thread, which the end of the step drains."""
        if self._pending is not None:
            return
        self._added.add(layer)
        if len(self._added) < self._kv.num_layers:
            return
        side = self._kv.side_stream
        if side is None:
            self._pending = self._kv.pending_sums(self.ids)
            return
        torch = self._kv.torch
        written = torch.cuda.Event()
        written.record()  # on the forward's stream: every layer's KV is in its blocks
        side.wait_event(written)
        with torch.cuda.stream(side):  # the buffers live and die on the side stream
            self._pending = self._kv.pending_sums(self.ids)

    def ready(self) -> bool:
        """Would ``value`` return without waiting (also with a layer missing: None then)?"""
        return self._pending is None or self._pending.ready()

    def value(self) -> np.ndarray | None:
        """``[L, R, blocks, parts]`` once every layer was added, else None."""
        return self._pending.value() if self._pending is not None else None


def int_rows(tensor: Any, region: KvRegion) -> Any:
    """``region``'s blocks as integer rows ``[num_blocks, block_bytes / width]`` over
    ``tensor``'s memory (the bytes a NIXL descriptor of the region covers; no copy)."""
    import torch

    width = tensor.element_size()
    ints = tensor.view(getattr(torch, INT_OF_WIDTH[width]))  # same width: any strides
    storage = ints.untyped_storage()
    offset, rest = divmod(region.base - storage.data_ptr(), width)
    if rest or region.stride % width or region.block_bytes % width:
        raise ValueError("a KV region is not aligned to its element width")
    if offset < 0 or region.base + region.span_bytes > storage.data_ptr() + storage.nbytes():
        raise ValueError("a KV region lies outside its tensor's memory")
    shape = (region.num_blocks, region.block_bytes // width)
    return ints.as_strided(shape, (region.stride // width, 1), offset)
