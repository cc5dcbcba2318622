"""P's first token, piece by piece: who samples it (the gateway's rule), when D's connector
reports a receive that asked for it (the decode side's wait), how the answer ends with it (the
scheduler half's decision), and the one change to a vLLM ``Request``
(``compat.continue_from``, on a real one, in a child process). That D's answers stay one engine's is
the integration suite's job (tests/integration/test_first_token.py, test_workers.py).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvpush.connector.params import (
    ConnectorSettings,
    DecodeWork,
    PrefillToken,
    ReceiveKind,
    TransferParams,
    first_token_end,
)
from kvpush.connector.transfer import Role, TransferEvent, TransferState
from kvpush.connector.vllm.decode_side import DecodeSide
from kvpush.connector.vllm.runtime import WorkerRuntime
from kvpush.connector.vllm.side import Rank
from kvpush.schemas.messages import (
    Abort,
    FailReason,
    FinishReason,
    FirstToken,
    KvFailed,
    SamplingSpec,
    TransferMode,
    WorkerRole,
)
from kvpush.services.gateway.routing import Route, first_token_by
from kvpush.services.workers.first_token import first_token_of, prefill_sampling
from kvpush.services.workers.handles import EngineOutput
from tests.unit.test_connector_sides import BLOCK, TID, Recorder

PUSH, PULL, LOCAL = TransferMode.PUSH, TransferMode.PULL, TransferMode.LOCAL
P, D = WorkerRole.PREFILL, WorkerRole.DECODE


# ---- who samples it ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "mode", "sends", "spec", "expected"),
    [
        (P, PUSH, True, SamplingSpec(temperature=0.0), P),
        (P, PULL, True, SamplingSpec(temperature=0.7), P),  # unseeded: P's draw is as good
        (P, PUSH, True, SamplingSpec(temperature=0.0, seed=3), P),  # greedy: no draw
        (P, PUSH, True, SamplingSpec(temperature=0.7, seed=3), D),  # D's draws would shift
        (P, PUSH, True, SamplingSpec(temperature=0.0, logprobs=2), D),  # not on the bus yet
        (P, PUSH, False, SamplingSpec(temperature=0.0), D),  # an older P sends none
        (P, LOCAL, True, SamplingSpec(temperature=0.0), D),  # nothing moves: D does it all
        (D, PUSH, True, SamplingSpec(temperature=0.0), D),  # the deployment said so
    ],
)
def test_the_gateway_lets_prefill_sample_the_first_token_where_one_engine_would_agree(
    choice: WorkerRole, mode: TransferMode, sends: bool, spec: SamplingSpec, expected: WorkerRole
) -> None:
    route = Route("p0", "d0", mode, 1, 1 if mode is not LOCAL else None, sends and mode != LOCAL)
    assert first_token_by(choice, route, spec) is expected


def test_prefill_samples_one_token_with_the_request_s_own_sampling() -> None:
    spec = SamplingSpec(max_tokens=9, min_tokens=4, temperature=0.5, top_k=7, stop=["x"])
    assert prefill_sampling(spec) == SamplingSpec(
        max_tokens=1, min_tokens=1, temperature=0.5, top_k=7, stop=["x"]
    )


@pytest.mark.parametrize(
    ("reason", "stop", "finish", "sent_stop"),
    [
        ("length", None, None, None),  # the one token P was asked for: not the answer's end
        ("stop", None, FinishReason.STOP, None),  # end of sequence
        ("stop", 7, FinishReason.STOP, 7),  # a stop token
        ("stop", "ab" * 200, FinishReason.STOP, "ab" * 128),  # a stop string, bounded
    ],
)
def test_prefill_s_first_token_says_whether_it_ends_the_answer(
    reason: str, stop: Any, finish: FinishReason | None, sent_stop: Any
) -> None:
    final = EngineOutput("r", [42], "t", reason, stop_reason=stop)
    token = first_token_of(TID, "p0", "d0", final)
    assert (token.token_id, token.finish_reason, token.stop_reason) == (42, finish, sent_stop)


# ---- the decode side waits for it ----------------------------------------------------------
def decode(wait_s: float = 2.0) -> tuple[DecodeSide, Recorder, list[int]]:
    woken: list[int] = []
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE, first_token_wait_s=wait_s)
    rec = Recorder()
    side = DecodeSide(settings, rec, rec, WorkerRuntime(lambda: woken.append(1)), Rank(), BLOCK)  # type: ignore[arg-type]
    return side, rec, woken


def asking(kind: ReceiveKind = ReceiveKind.PUSH, mode: TransferMode = PUSH) -> list[DecodeWork]:
    params = TransferParams(TID, "p0", "d0", mode, first_token_from_prefill=True)
    return [DecodeWork(kind, "r0", params, [5, 6], 0, 8)]


def token(token_id: int = 42, **fields: Any) -> FirstToken:
    return FirstToken(transfer_id=TID, prefill_id="p0", decode_id="d0", token_id=token_id, **fields)


DONE = TransferEvent(TID, Role.TARGET, TransferState.DONE, quiesced=True)


def test_a_landed_receive_is_reported_once_prefill_s_token_came_and_takes_it_up() -> None:
    side, _, woken = decode()
    side.on_work(asking())
    assert side.collect([DONE]) == (set(), {})  # the KV is in, the token is not
    side.on_pushed("", token(finish_reason=FinishReason.STOP, stop_reason=9))
    assert woken  # the driver steps at once to report it
    assert side.collect([]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42, "stop", 9)}
    assert side.take_first_tokens() == {} and not side._by_tid


def test_a_token_before_the_request_is_kept_for_it() -> None:
    side, _, _ = decode()
    side.on_pushed("", token())  # P's service was quicker than D's engine
    side.on_work(asking(ReceiveKind.PULL, PULL))
    assert side.collect([DONE]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42)}


def test_without_prefill_s_token_the_receive_is_reported_after_the_wait() -> None:
    side, _, _ = decode(wait_s=0.0)
    side.on_work(asking())
    assert side.collect([DONE]) == ({"r0"}, {})  # waited 0 s: D samples the token itself
    assert side.take_first_tokens() == {}


def test_a_failed_receive_never_waits_and_carries_no_token() -> None:
    side, _, _ = decode()
    side.on_work(asking())
    side.on_pushed("", token())
    side.on_bus(
        "", KvFailed(transfer_id=TID, prefill_id="p0", decode_id="d0", reason=FailReason.POST)
    )
    failed = TransferEvent(TID, Role.TARGET, TransferState.FAILED, quiesced=True)
    assert side.collect([failed]) == (set(), {"r0": [5, 6]})  # D computes the whole answer
    assert side.take_first_tokens() == {}


def test_a_request_ended_while_waiting_for_the_token_gives_its_blocks_back_without_it() -> None:
    side, _, _ = decode()
    side.on_work(asking())
    assert side.collect([DONE]) == (set(), {})  # landed, waiting for P's token
    params = TransferParams(TID, "p0", "d0", PUSH, first_token_from_prefill=True)
    side.on_work([DecodeWork(ReceiveKind.ABORT, "r0", params)])  # the client left
    assert side.collect([]) == ({"r0"}, {})  # reported: vLLM frees the blocks
    assert side.take_first_tokens() == {} and not side._by_tid


def test_late_word_from_prefill_on_a_landed_receive_changes_nothing() -> None:
    side, rec, _ = decode()
    side.on_work(asking())
    side.collect([DONE])
    refusal = KvFailed(transfer_id=TID, prefill_id="p0", decode_id="d0", reason=FailReason.POST)
    side.on_bus("", refusal)  # e.g. a KvFailed that crossed the notice
    assert not rec.messages(Abort)  # no abort sent for KV that already landed
    side.on_pushed("", token())
    assert side.collect([]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42)}


def test_a_late_token_of_a_prompt_decode_computes_itself_is_dropped() -> None:
    side, _, _ = decode()
    params = TransferParams(TID, "p0", "d0", PUSH, first_token_from_prefill=True)
    side.on_work([DecodeWork(ReceiveKind.LOCAL, "r0", params)])
    side.on_pushed("", token())
    assert TID not in side._early and not side._by_tid


# ---- how the answer ends with it (the scheduler half's decision) ---------------------------
@pytest.mark.parametrize(
    ("first", "max_tokens", "num_tokens", "expected"),
    [
        (PrefillToken(42), 8, 8, PrefillToken(42)),  # the request goes on from it
        (PrefillToken(42, "stop"), 8, 8, PrefillToken(42, "stop")),  # end of sequence
        (PrefillToken(42, "stop", 42), 8, 8, PrefillToken(42, "stop", 42)),  # a stop token
        # a stop string: D's detokenizer ends the answer; the request goes on meanwhile
        (PrefillToken(42, "stop", "\n"), 8, 8, PrefillToken(42, None, "\n")),
        (PrefillToken(42), 1, 8, PrefillToken(42, "length")),  # one token asked for
        (PrefillToken(42), 8, 999, PrefillToken(42, "length")),  # the token fills the context
    ],
)
def test_the_answer_ends_with_the_token_as_one_engine_s_stop_check_says(
    first: PrefillToken, max_tokens: int, num_tokens: int, expected: PrefillToken
) -> None:
    assert first_token_end(first, max_tokens, num_tokens, max_model_len=1000) == expected


# ---- the one change to a vLLM Request (in a child process: vLLM stays out of pytest's) -----
CONTINUE_FROM = f"""
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from kvpush.connector.vllm import compat

B = {BLOCK}
init_none_hash(sha256)
params = SamplingParams(max_tokens=5, min_tokens=2)
req = Request("r0", list(range(2 * B - 1)), params, None,
              block_hasher=get_request_block_hasher(B, sha256))
assert len(req.block_hashes) == 1
compat.continue_from(req, 99)
assert req.prompt_token_ids[-1] == 99 and req.num_prompt_tokens == 2 * B
assert list(req.all_token_ids) == [*range(2 * B - 1), 99] and req.num_tokens == 2 * B
assert len(req.block_hashes) == 2, "the block the token completed is hashed"
got = (req.max_tokens, req.sampling_params.max_tokens, req.sampling_params.min_tokens)
assert got == (4, 4, 1), got
assert (params.max_tokens, params.min_tokens) == (5, 2), "the caller's object is untouched"
print("ok")
"""


def test_continue_from_makes_the_token_the_last_prompt_token_of_a_real_request() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CONTINUE_FROM], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---- the scheduler half's bookkeeping (in a child process, like the Request above) ----------
SCHEDULER_HALF = f"""
from types import SimpleNamespace as NS
from vllm import SamplingParams
from kvpush.connector.params import ConnectorSettings, PrefillToken, TransferParams
from kvpush.connector.vllm import compat
from kvpush.connector.vllm.metadata import KVPushWorkerMeta
from kvpush.connector.vllm.scheduler import SchedulerHalf
from kvpush.schemas.messages import WorkerRole

B, continued = {BLOCK}, []
compat.continue_from = lambda req, token_id: continued.append((req.request_id, token_id))

def half(free=10, driver=True):
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE)
    h = SchedulerHalf(settings, B, f"t-{{len(continued)}}-{{free}}-{{driver}}", 1000)
    h.driver_takes_tokens, h.free_blocks = driver, (lambda: free)
    return h

def request(rid, n=B + 1, **sampling):
    params = TransferParams(f"tx-{{rid}}xxxx", "p0", "d0", first_token_from_prefill=True)
    sp = SamplingParams(max_tokens=8, **sampling)
    return NS(request_id=rid, kv_transfer_params=params.to_params(), num_prompt_tokens=n,
              num_tokens=n, max_tokens=8, sampling_params=sp, status=NS(name="RUNNING"))

def alloc(h, req):
    blocks = NS(get_block_ids=lambda: (list(range(9)),))
    h.update_state_after_alloc(req, blocks, req.num_prompt_tokens)
    return h._meta.decode[-1].params.first_token_from_prefill

def step(h, tokens, finished):
    out = NS(kv_connector_worker_meta=KVPushWorkerMeta({{}}, tokens),
             finished_recving=set(finished), finished_sending=set())
    h.update_connector_output(out)
    return h.take_prefill_tokens()

# a rank's token a step before the receive ends (TP) is kept for it
h = half()
assert alloc(h, request("a"))
assert step(h, {{"a": PrefillToken(5), "x": PrefillToken(6)}}, []) == []
assert "x" not in h._prefill_tokens  # a request that did not ask: dropped
assert step(h, {{}}, ["a"]) == [("a", PrefillToken(5))] and continued == [("a", 5)]
assert h._marks.take("tx-axxxx").prefill_token > 0  # D continued from P's token
# a request that ends while waiting forgets its token
assert alloc(h, request("b"))
ended = NS(request_id="b", kv_transfer_params=None, status=NS(name="FINISHED_ABORTED"))
h.request_finished(ended, [])
assert step(h, {{"b": PrefillToken(7)}}, ["b"]) == [] and "b" not in h._requests_awaiting_token
# without a driver, with log-probabilities or seeded sampling, D samples the token itself
assert not alloc(half(driver=False), request("c"))
assert not alloc(h, request("d", logprobs=2))
assert not alloc(h, request("e", temperature=0.7, seed=3))
assert alloc(h, request("f", temperature=0.7))  # unseeded: P's draw is as good as D's
# a token whose KV opens a block continues only while a free block is left for it
h0 = half(free=1)
for rid in ("g", "i"):
    assert alloc(h0, request(rid, n=2 * B))
got = step(h0, {{"g": PrefillToken(1), "i": PrefillToken(2)}}, ["g", "i"])
assert got in ([("g", PrefillToken(1))], [("i", PrefillToken(2))]), got  # the one free block
# an aborted request's marks stay for the driver (its output is already out)
h._marks.record("tx-jxxxx", kv_landed=1)
aborted = NS(request_id="j", kv_transfer_params=request("j").kv_transfer_params,
             status=NS(name="FINISHED_ABORTED"))
assert h.request_finished(aborted, []) == (False, None)
assert h.take_timing("tx-jxxxx").kv_landed == 1
# every rank's tokens merge
merged = KVPushWorkerMeta({{}}, {{"a": PrefillToken(1)}}).aggregate(
    KVPushWorkerMeta({{}}, {{"b": PrefillToken(2)}}))
assert merged.first_tokens == {{"a": PrefillToken(1), "b": PrefillToken(2)}}
for x in (h, h0):
    x.shutdown()
print("ok")
"""


def test_the_scheduler_half_keeps_continues_and_forgets_prefill_tokens() -> None:
    """A token from one rank waits for the receive's end; tokens nobody asked for, and those of
    requests that ended, are dropped; no driver, log-probabilities or seeded sampling: D
    samples the token itself; a token whose KV needs a new block continues only while one is
    free; an aborted request's marks stay for the driver; the ranks' tokens merge."""
    done = subprocess.run(
        [sys.executable, "-c", SCHEDULER_HALF], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
