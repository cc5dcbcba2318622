"""KV integrity on by default, between the session's real engines (real NIXL, nats-server): every
push and pull is verified by D before the request runs, and says so.

Each answer must be one engine's (D computing the prompt alone), with the KV reported landed
(no fallback), and its final output must carry the receive's integrity outcome
(``kv_transfer_params["kvpush_integrity"]``) with the engine's counts: ``verified`` where P's
checksum of every block it sent equals D's of what landed; ``unchecked`` (counted, never passed
off as verified) for a pull of a prompt whose prefix D held, whose checksum P computed over
blocks D did not read. Faults that the checksum and the allocation epoch must catch are in
test_connector_faults.py.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from tests.integration.engine_proc import EngineProc
from tests.integration.test_connector_vllm import BLOCK, prompt, reference, request, run_pd

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_leaked_blocks")]


def integrity(out: dict[str, Any]) -> dict[str, Any]:
    """The receive's outcome and the engine's counts, from a decode request's final output."""
    found = (out["kv_transfer_params"] or {}).get("kvpush_integrity")
    assert found is not None, out
    return found


def test_push_and_pull_are_verified_and_counted(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    counts: dict[str, int] = {}
    for mode in ("push", "pull", "push"):
        ids = prompt(rng, 2 * BLOCK + 61)
        expected = reference(pd_engines[1], ids)
        _, d_out = run_pd(pd_engines, ids, ids, mode)  # asserts the KV landed: no fallback
        assert d_out["token_ids"] == expected
        seen = integrity(d_out)
        assert seen["outcome"] == "verified", (mode, seen)
        if counts:  # the engine's counter moved by this receive, and only by it
            assert seen["counts"]["verified"] == counts["verified"] + 1, (counts, seen)
            assert seen["counts"].get("mismatch", 0) == counts.get("mismatch", 0)
        counts = seen["counts"]


@pytest.mark.parametrize(("mode", "outcome"), [("push", "verified"), ("pull", "unchecked")])
def test_a_prefix_decode_holds_is_verified_in_push_and_unchecked_in_pull(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random, mode: str, outcome: str
) -> None:
    """D holds the first 2 of 4 blocks: a push moves (and checks) only the other 2, P's
    checksum starting at D's hit; a pull's KvReady checksum covers all 4, so D cannot check
    the 2 it read and must say so."""
    decode = pd_engines[1]
    shared = prompt(rng, 2 * BLOCK)
    (warm,) = decode.generate([request(f"warm-{uuid.uuid4().hex[:8]}", shared + prompt(rng, 60))])
    assert warm["error"] is None
    ids = shared + prompt(rng, BLOCK + 30)
    expected = reference(decode, ids)
    _, d_out = run_pd(pd_engines, ids, ids, mode)
    assert d_out["token_ids"] == expected
    assert d_out["num_cached_tokens"] >= 2 * BLOCK  # D's hit: only the rest moved
    seen = integrity(d_out)
    assert seen["outcome"] == outcome, seen
    assert seen["counts"].get(outcome, 0) >= 1
