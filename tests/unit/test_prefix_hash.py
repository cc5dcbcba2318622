"""The chained prefix hash both workers and the gateway compute (schemas/prefix.py)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvpush.schemas.prefix import (
    BASE,
    ROOT,
    TABLE_TOKENS,
    BlockHasher,
    PromptHasher,
    block_hashes,
    iter_block_hashes,
)

KNOWN_8_BY_4 = [3256525755571062675, -2556502652947121803]
KNOWN_000_BY_2 = [1360621569767560655]


def test_known_values_are_stable() -> None:
    # a change of these is a protocol change: gateways and workers must agree
    assert block_hashes(list(range(8)), 4) == KNOWN_8_BY_4
    assert block_hashes([0, 0, 0], 2) == KNOWN_000_BY_2


def test_the_hash_is_the_polynomial_of_the_tokens_plus_one_from_root() -> None:
    tokens = [1, 70000, 3]
    value = ROOT
    for token in tokens:
        value = (value * BASE + token + 1) % (1 << 64)
    expected = value - (1 << 64) if value >= 1 << 63 else value
    assert block_hashes(tokens, 3) == [expected]


def test_each_hash_chains_on_its_parent() -> None:
    tokens = list(range(100, 112))
    first, second, third = block_hashes(tokens, 4)
    assert block_hashes(tokens[4:], 4, parent=first) == [second, third]
    assert block_hashes(tokens[8:], 4, parent=second) == [third]
    # the same block after another prefix is another prefix: another hash
    assert block_hashes(tokens[4:8], 4) != [second]


def test_the_partial_last_block_has_no_hash() -> None:
    assert block_hashes(list(range(11)), 4) == block_hashes(list(range(8)), 4)
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([], 4) == []


def test_the_incremental_form_gives_the_same_hashes() -> None:
    tokens = list(range(50, 62))
    hasher = BlockHasher(4)
    assert [hasher.feed(tokens[i : i + 4]) for i in range(0, 12, 4)] == block_hashes(tokens, 4)
    assert hasher.last == block_hashes(tokens, 4)[-1]
    with pytest.raises(ValueError):
        hasher.feed([1, 2])


def test_the_walk_is_lazy() -> None:
    walk = iter_block_hashes(list(range(4000)), 16)
    assert next(walk) == block_hashes(list(range(16)), 16)[0]


def test_a_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_another_process_computes_the_same_hashes() -> None:
    code = "from kvpush.schemas.prefix import block_hashes as h; print(h(list(range(64)), 16))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == str(block_hashes(list(range(64)), 16))


@pytest.mark.parametrize("length", [15, 16, 17, 16 * 127, 16 * 300 + 5, (1 << 15) + 48])
def test_long_prompts_hash_as_block_by_block(length: int) -> None:
    tokens = [(7 * i) % 50_000 for i in range(length)]
    hasher = BlockHasher(16)
    expected = [hasher.feed(tokens[i : i + 16]) for i in range(0, length - 15, 16)]
    assert block_hashes(tokens, 16) == expected


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_the_prompt_hasher_hashes_as_the_chain_and_the_walk(block_size: int) -> None:
    """The prefix index's ``PromptHasher``: its first block alone and its chain (contiguous
    tables of block ends, a C-level pass for the first block) are those of ``block_hashes``."""
    rng = random.Random(block_size)
    hasher = PromptHasher(block_size)
    lengths = [0, 1, block_size - 1, block_size, 5 * block_size + 1, 8192, TABLE_TOKENS]
    for length in [*lengths, TABLE_TOKENS + 2 * block_size + 1]:
        tokens = [rng.randrange(1 << 32) for _ in range(length)]
        expected = block_hashes(tokens, block_size)
        assert hasher.chain(tokens).tolist() == expected
        assert hasher.chain(tuple(tokens)).tolist() == expected  # any sequence
        if length >= block_size:
            assert (
                hasher.first(tokens)
                == expected[0]
                == BlockHasher(block_size).feed(tokens[:block_size])
            )
    with pytest.raises(ValueError):
        hasher.first([1] * (block_size - 1))
    with pytest.raises(ValueError):
        PromptHasher(0)
