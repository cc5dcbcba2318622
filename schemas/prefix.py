"""The one chained block hash of prompt prefixes, shared by workers and the gateway.

A prompt's KV is cached by vLLM in whole blocks of ``block_size`` tokens; the prefix that ends
with block ``i`` is named by a polynomial hash over every token of the prefix, modulo 2**64:
``H(prefix + token) = H(prefix) * BASE + (token + 1)``, starting at ``H() = ROOT`` (or at a
given parent's hash), read as a signed int64 (JSON and msgspec carry it as is). A hash so names
the whole prefix up to the end of its block, not the block alone, chains on its parent (the
hash of the prefix before the block: ``H(parent + block) = H(parent) * BASE**len(block) +
poly(block)``), and is the same in every process and on every machine (Python's ``hash()`` is
salted per process and is never used). A partial last block has no hash: vLLM caches whole
blocks only. Workers turn vLLM's own block hashes (engine-specific, salted per engine) into these
(``services/workers/cache_events.py``); the gateway hashes a prompt the same way to ask its
prefix index (``services/gateway/prefix_index.py``) which worker holds how much of it.

Why a polynomial: it is computed for a whole prompt at once with numpy (``H(m) = BASE**m *
(parent + sum_j (t_j + 1) * BASE**-(j + 1))``, BASE odd so it has an inverse modulo 2**64), so a
routing decision hashes an 8k-token prompt in tens of microseconds. It is no cryptographic hash:
a crafted prompt can collide with another. A collision only misleads routing (the engine checks
its own hashes before it reuses a block), never the KV.

The prefix index hashes every prompt it is asked about with a ``PromptHasher`` (one per block
size: the first block alone, then, where some worker holds that, the whole chain from the
root, with that block size's tables of block ends kept contiguous).

Threading model: none (pure functions over read-only tables; ``BlockHasher`` is a value of one
caller, ``PromptHasher`` is read-only once made).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np

ROOT: Final = 0x6B7670757368_0001  # the hash of the empty prefix ("kvpush" 1)
BASE: Final = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_MASK: Final = (1 << 64) - 1
_SIGN: Final = 1 << 63
_BASE_INV: Final = pow(BASE, -1, 1 << 64)
TABLE_TOKENS: Final = 1 << 15  # powers kept for prompts up to this long (longer: computed)
_WORD: Final = next(code for code in "LQ" if array(code).itemsize == 8)  # array's uint64


def _powers(base: int, count: int) -> np.ndarray:
    """``base**1 .. base**count`` modulo 2**64 (uint64 products wrap)."""
    powers = np.cumprod(np.full(count, base, dtype=np.uint64), dtype=np.uint64)
    powers.flags.writeable = False
    return powers


def _running_sums(values: np.ndarray) -> np.ndarray:
    sums = np.cumsum(values, dtype=np.uint64)
    sums.flags.writeable = False
    return sums


_POWERS: Final = _powers(BASE, TABLE_TOKENS)
_INVERSE_POWERS: Final = _powers(_BASE_INV, TABLE_TOKENS)
_INVERSE_SUMS: Final = _running_sums(_INVERSE_POWERS)  # the "+ 1" of every token, summed


def _signed(value: int) -> int:
    return value - (1 << 64) if value & _SIGN else value


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The hash of each whole block of ``token_ids`` chained from ``parent`` (the partial last
    block has none)."""
    return chain_hashes(token_ids, block_size, parent).tolist()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> np.ndarray:
    """``block_hashes`` as an int64 array (a caller that reads a few of them skips the list:
    ``chain.item(i)`` is the Python int)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    whole = len(token_ids) - len(token_ids) % block_size
    if whole == 0:
        return np.empty(0, dtype=np.int64)
    tokens = np.frombuffer(_words(token_ids), dtype=np.uint64)[:whole]
    if whole <= TABLE_TOKENS:
        powers, inverse = _POWERS[:whole], _INVERSE_POWERS[:whole]
        ones = _INVERSE_SUMS[block_size - 1 : whole : block_size]
    else:
        powers, inverse = _powers(BASE, whole), _powers(_BASE_INV, whole)
        ones = _running_sums(inverse)[block_size - 1 :: block_size]
    # sum_j (t_j + 1) * BASE**-(j + 1) up to each block's end: the tokens' part (in place: the
    # words are this call's own), then the ones'
    tokens *= inverse
    sums = np.add.accumulate(tokens, out=tokens)[block_size - 1 :: block_size]
    sums += ones
    sums += np.uint64(parent & _MASK)
    sums *= powers[block_size - 1 :: block_size]
    return sums.view(np.int64)


def _words(token_ids: Sequence[int]) -> array[int]:
    """The token ids as unsigned 64-bit words (every token id is below 2**32), whole: slicing
    the list first copies it. ``fromlist`` converts a list faster than ``array(code, list)``,
    which reads it item by item through the generic sequence protocol."""
    if not isinstance(token_ids, list):
        return array(_WORD, token_ids)
    words = array(_WORD)
    words.fromlist(token_ids)
    return words


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT
) -> Iterator[int]:
    """``block_hashes`` one at a time (the first block's alone first, so a walk that stops at
    the first block hashes no more than that)."""
    first = block_hashes(token_ids[:block_size], block_size, parent)
    if not first:
        return
    yield first[0]
    yield from block_hashes(token_ids[block_size:], block_size, first[0])


class PromptHasher:
    """A prompt's hashes from ``ROOT`` for one block size, that size's tables kept: ``first``
    hashes the first block alone in one C-level pass over its tokens (``H = ROOT * BASE**n +
    sum_j (t_j + 1) * BASE**(n - 1 - j)`` modulo 2**64, ``n`` the block size; ``BlockHasher``
    steps a token at a time), ``chain`` every whole block as ``chain_hashes(token_ids, n)``
    does, with the root's and the ones' part and the powers at each block's end read from
    contiguous tables (not every ``n``-th entry of the token tables)."""

    __slots__ = ("_end_powers", "_end_sums", "_first_constant", "_first_powers", "block_size")

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self._first_powers = [pow(BASE, block_size - 1 - j, 1 << 64) for j in range(block_size)]
        # the root's part and every token's "+ 1"
        first = ROOT * pow(BASE, block_size, 1 << 64) + sum(self._first_powers)
        self._first_constant = first & _MASK
        ends = slice(block_size - 1, TABLE_TOKENS, block_size)  # each block's last token
        self._end_powers = np.ascontiguousarray(_POWERS[ends])
        self._end_sums = _INVERSE_SUMS[ends] + np.uint64(ROOT)  # the ones' part and the root's
        self._end_powers.flags.writeable = self._end_sums.flags.writeable = False

    def first(self, token_ids: Sequence[int]) -> int:
        """The hash of the first ``block_size`` tokens of ``token_ids`` (the rest are not read:
        ``map`` stops at the powers' end, no slice of the prompt is copied)."""
        if len(token_ids) < self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, not {len(token_ids)}")
        products = sum(map(operator.mul, token_ids, self._first_powers))
        return _signed((products + self._first_constant) & _MASK)

    def chain(self, token_ids: Sequence[int]) -> np.ndarray:
        """``chain_hashes(token_ids, block_size)``."""
        block_size = self.block_size
        whole = len(token_ids) - len(token_ids) % block_size
        if whole == 0 or whole > TABLE_TOKENS:
            return chain_hashes(token_ids, block_size)
        blocks = whole // block_size
        tokens = np.frombuffer(_words(token_ids), dtype=np.uint64, count=whole)
        tokens *= _INVERSE_POWERS[:whole]  # as chain_hashes, in place: the words are this call's
        np.add.accumulate(tokens, out=tokens)
        sums = np.add(tokens[block_size - 1 :: block_size], self._end_sums[:blocks])
        sums *= self._end_powers[:blocks]
        return sums.view(np.int64)


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
        value = self.last & _MASK
        for token in block:
            value = (value * BASE + token + 1) & _MASK
        self.last = _signed(value)
        return self.last
