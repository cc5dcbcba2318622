"""The one chained block hash of prompt prefixes, shared by workers and the gateway.

A prompt's KV is cached by vLLM in whole blocks of ``block_size`` tokens; block ``i`` is named
by ``h_i = blake2b-64(h_{i-1} as 8 bytes little-endian || tokens of block i as little-endian
uint32)``, read as a signed little-endian int64 (JSON and msgspec carry it as is), with
``h_{-1} = ROOT``. A hash so names the whole prefix up to the end of its block,
not the block alone, and is the same in every process and on every machine (Python's ``hash()``
is salted per process and is never used). A partial last block has no hash: vLLM caches whole
blocks only. Workers turn vLLM's own block hashes (engine-specific, salted per engine) into these
(``services/workers/cache_events.py``); the gateway hashes a prompt the same way to ask its
prefix index (``services/gateway/prefix_index.py``) which worker holds how much of it.

Threading model: none (pure functions; ``BlockHasher`` is a value of one caller).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from hashlib import blake2b
from typing import Final

ROOT: Final = 0x6B7670757368_0001  # the parent of a prompt's first block ("kvpush" 1)
HASH_BYTES: Final = 8
CHUNK_BLOCKS: Final = 64  # the most blocks iter_block_hashes packs at once
_LITTLE: Final = sys.byteorder == "little"


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """The tokens as little-endian uint32 (a token id is below 2**32)."""
    packed = array("I", token_ids)  # 4 bytes on every platform vLLM runs on
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _chain(parent: int, block: bytes | memoryview) -> int:
    digest = blake2b(parent.to_bytes(HASH_BYTES, "little", signed=True), digest_size=HASH_BYTES)
    digest.update(block)
    return int.from_bytes(digest.digest(), "little", signed=True)


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT
) -> Iterator[int]:
    """The hash of each whole block of ``token_ids``, lazily (stop early by not asking on).
    Tokens are packed 1, 2, 4, ... up to ``CHUNK_BLOCKS`` blocks at a time: an early stop packs
    little more than it hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    parent_bytes = parent.to_bytes(HASH_BYTES, "little", signed=True)
    block_bytes = block_size * 4
    first, blocks = 0, 1
    while first + block_size <= len(token_ids):
        chunk = token_ids[first : first + blocks * block_size]
        first, blocks = first + len(chunk), min(blocks * 2, CHUNK_BLOCKS)
        whole = len(chunk) - len(chunk) % block_size
        view = memoryview(_tokens_bytes(chunk[:whole]))
        for start in range(0, whole * 4, block_bytes):
            digest = blake2b(parent_bytes, digest_size=HASH_BYTES)
            digest.update(view[start : start + block_bytes])
            parent_bytes = digest.digest()
            yield int.from_bytes(parent_bytes, "little", signed=True)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The hash of each whole block of ``token_ids`` chained from ``parent`` (the partial last
    block has none)."""
    return list(iter_block_hashes(token_ids, block_size, parent))


class BlockHasher:
    """The incremental form: feed whole blocks one at a time, each gets the chained hash."""

    __slots__ = ("block_size", "last")

    def __init__(self, block_size: int, parent: int = ROOT) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.last = parent  # the hash of the prefix fed so far (ROOT: nothing yet)

    def feed(self, block: Sequence[int]) -> int:
        """The hash of the prefix ending with ``block`` (exactly ``block_size`` tokens)."""
        if len(block) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, not {len(block)}")
        self.last = _chain(self.last, _tokens_bytes(block))
        return self.last
