"""Whether two engines may exchange KV blocks, and how when their tensor parallelism differs.

Owns:
- ``CompatInfo`` / ``compat_hash`` / ``compat_diff``: what must be equal (kvpush protocol,
  model, dtype, block size, per-block layout name). TP is not hashed: it is mapped.
- ``geometry_diff``: two pools' bytes per block must be one common ratio (1, or k / 1/k at
  another TP); ``slice_diff``: the slices a rank pair exchanges must be the same size.
- TP mapping. vLLM gives TP rank r of t the KV heads [r*H/t, (r+1)*H/t). Where a block's heads
  are contiguous byte ranges (``HEAD_MAJOR_LAYOUTS``) a rank of the smaller TP exchanges a byte
  ``Slice`` of each of its blocks with each rank of the larger TP that holds those heads: P of
  TP 2 -> D of TP 1 writes each P rank's whole block into half of D's block; P of 1 -> D of 2
  writes each half of P's block into one D rank's whole block. ``tp_slices`` gives a rank
  pair's slices (or refuses the pair), ``peer_ranks`` which ranks of a peer hold our heads.

Threading model: none (pure functions over frozen structs).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvpush.connector.layout import WHOLE, PoolLayout, Slice
from kvpush.schemas.messages import PROTOCOL_VERSION


class CompatInfo(msgspec.Struct, frozen=True):
    """What must match between two engines that exchange KV blocks (TP maps: ``tp_slices``)."""

    model: str
    dtype: str
    block_size: int
    layout: str
    protocol: int = PROTOCOL_VERSION


def compat_hash(info: CompatInfo) -> str:
    """32 hex chars (fits the bus ``CompatHash`` pattern): sha256 of the canonical JSON."""
    return hashlib.sha256(msgspec.json.encode(info, order="sorted")).hexdigest()[:32]


def compat_diff(local: CompatInfo, peer: CompatInfo) -> list[str]:
    """Human-readable differences, e.g. ``["dtype: local float32, peer float16"]``."""
    pairs = (
        (field, getattr(local, field), getattr(peer, field)) for field in local.__struct_fields__
    )
    return [f"{field}: local {a!r}, peer {b!r}" for field, a, b in pairs if a != b]


def geometry_diff(local: PoolLayout, peer: PoolLayout) -> list[str]:
    """Why two pools cannot exchange blocks at any TP: memory type, layer/region count, or
    bytes per block that are not one common ratio (1, k or 1/k for a different TP)."""
    out = []
    if local.mem_type != peer.mem_type:
        out.append(f"mem_type: local {local.mem_type.value}, peer {peer.mem_type.value}")
    mine, theirs = local.geometry(), peer.geometry()
    shape_differs = [len(r) for r in mine] != [len(r) for r in theirs]
    ratios = {
        (a // b if a >= b else -(b // a)) if max(a, b) % min(a, b) == 0 else 0
        for ra, rb in zip(mine, theirs, strict=False)
        for a, b in zip(ra, rb, strict=False)
    }
    if shape_differs or len(ratios) > 1 or 0 in ratios:
        out.append(f"bytes per block per layer/region: local {_short(mine)}, peer {_short(theirs)}")
    return out


def slice_diff(local: PoolLayout, remote: PoolLayout, mine: Slice, theirs: Slice) -> list[str]:
    """Why our ``mine`` slice and the peer's ``theirs`` slice of each block do not match in size
    (e.g. the KV heads did not split evenly, or vLLM replicated heads at a high TP)."""
    for layer, (lregs, rregs) in enumerate(zip(local.layers, remote.layers, strict=True)):
        for lreg, rreg in zip(lregs, rregs, strict=True):
            ours, peers = lreg.block_bytes // mine.parts, rreg.block_bytes // theirs.parts
            if ours != peers or lreg.block_bytes % mine.parts or rreg.block_bytes % theirs.parts:
                return [
                    f"layer {layer}: {lreg.block_bytes} B blocks split in {mine.parts} here and"
                    f" {rreg.block_bytes} B blocks in {theirs.parts} at the peer do not match"
                    " (KV heads do not map one to one between the two TP sizes)"
                ]
    return []


def _short(geometry: list[list[int]]) -> str:
    text = str(geometry)
    return text if len(text) <= 80 else text[:77] + "..."


# vLLM's per-layer KV cache, logical [blocks, kv_heads, block_size, 2*head_dim] (K and V packed
# in the last dim) on CPU and with FlashAttention on GPU; in memory a block is either
VLLM_CPU_LAYOUT = "vllm-paged-LBHNC"  # heads outer (CPU; GPU with VLLM_KV_CACHE_LAYOUT=HND)
VLLM_TOKEN_MAJOR_LAYOUT = "vllm-paged-LBNHC"  # or tokens outer (GPU FlashAttention, NHD default)
HEAD_MAJOR_LAYOUTS = frozenset({VLLM_CPU_LAYOUT})  # a block's KV heads are contiguous bytes


def paged_layout_name(strides: tuple[int, ...]) -> str:
    """The layout name of a vLLM per-layer cache tensor from its strides (logical dims
    [blocks, kv_heads, block_size, 2*head_dim]): which of heads and tokens is outer in a block."""
    if len(strides) != 4:
        raise ValueError(f"a vLLM paged KV cache has 4 dims, not {len(strides)}")
    return VLLM_CPU_LAYOUT if strides[1] >= strides[2] else VLLM_TOKEN_MAJOR_LAYOUT


class TpMismatch(ValueError):
    """Two ranks of different TP whose KV cannot be mapped onto each other."""


def tp_slices(rank: int, tp: int, peer_rank: int, peer_tp: int, layout: str) -> tuple[Slice, Slice]:
    """(our slice, the peer's slice) of every block that rank ``rank`` of ``tp`` exchanges with
    rank ``peer_rank`` of ``peer_tp``. vLLM gives rank r of t the KV heads [r*H/t, (r+1)*H/t):
    with k = peer_tp/tp ranks of the peer per rank of ours, peer rank j holds part j mod k of
    our block; the other way round our whole block is part ``rank mod k`` of the peer's.
    Raises ``TpMismatch`` when one TP does not divide the other, the ranks hold no common heads
    or the layout does not keep a block's heads contiguous."""
    if tp == peer_tp:
        if rank != peer_rank:
            raise TpMismatch(f"rank {rank} of {tp} does not pair with rank {peer_rank}")
        return WHOLE, WHOLE
    big, small = max(tp, peer_tp), min(tp, peer_tp)
    if big % small:
        raise TpMismatch(
            f"tensor parallel {tp} and {peer_tp} do not map: one must divide the other"
        )
    if layout not in HEAD_MAJOR_LAYOUTS:
        raise TpMismatch(
            f"tensor parallel {tp} and {peer_tp} differ and layout {layout!r} does not keep a"
            " block's KV heads contiguous, so they cannot be split or merged"
        )
    k = big // small
    if tp < peer_tp:
        if peer_rank // k != rank:
            raise TpMismatch(f"rank {rank} of {tp} holds no heads of rank {peer_rank} of {peer_tp}")
        return Slice(peer_rank % k, k), WHOLE
    if rank // k != peer_rank:
        raise TpMismatch(f"rank {rank} of {tp} holds no heads of rank {peer_rank} of {peer_tp}")
    return WHOLE, Slice(rank % k, k)


def peer_ranks(rank: int, tp: int, peer_tp: int) -> list[int]:
    """The ranks of a peer of ``peer_tp`` that hold some of the KV heads of our rank."""
    if peer_tp <= tp:
        return [rank * peer_tp // tp]
    k = peer_tp // tp
    return list(range(rank * k, (rank + 1) * k))
