"""The bus contract: every message round-trips; anything malformed raises MessageError only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.schemas import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    CacheEvents,
    CacheSync,
    FailReason,
    FinishReason,
    FirstToken,
    KvFailed,
    KvPushed,
    KvPushing,
    KvReady,
    LayerTiming,
    MessageError,
    MessageErrorKind,
    RequestEvent,
    SamplingSpec,
    TokenChunk,
    TransferMode,
    Usage,
    WorkerHeartbeat,
    WorkerRole,
    decode,
    encode,
    subjects,
)
from kvpush.schemas import export as schema_export
from kvpush.schemas.messages import ALL_MESSAGES, MAX_PROMPT_TOKENS

TID = "tx-0123456789"
ADDR = "tcp://127.0.0.1:5555"
HASH = "0123456789abcdef"

SAMPLES: list[tuple[str, object]] = [
    (
        subjects.request("p0", "d0"),
        RequestEvent(
            transfer_id=TID,
            request_id="cmpl-1",
            prefill_id="p0",
            decode_id="d0",
            model="tiny",
            prompt_token_ids=[1, 2, 3],
            reply_subject=subjects.tokens("gw0"),
            deadline_ms=10**12,
            sampling=SamplingSpec(max_tokens=8, temperature=0.0, stop=["\n"], seed=7),
            mode=TransferMode.PULL,
            first_token_by=WorkerRole.PREFILL,
        ),
    ),
    (
        subjects.blocks("p0"),
        BlocksAnnounced(
            transfer_id=TID,
            decode_id="d0",
            decode_epoch=3,
            block_runs=[(3, 3), (9, 1)],
            first_token=128,
            num_tokens=700,
            compat_hash=HASH,
            side_channel=ADDR,
        ),
    ),
    (
        subjects.kv_ready("d0"),
        KvReady(
            transfer_id=TID,
            prefill_id="p0",
            prefill_epoch=1,
            block_runs=[(0, 2)],
            num_tokens=200,
            compat_hash=HASH,
            side_channel=ADDR,
        ),
    ),
    (
        subjects.kv_done("d0"),
        KvPushed(
            transfer_id=TID,
            prefill_id="p0",
            decode_id="d0",
            bytes=1 << 20,
            descriptors=4,
            num_tokens=256,
            push_ms=1.5,
            layers=[LayerTiming(0, 0.1, 0.4)],
        ),
    ),
    (
        subjects.kv_done("d0"),
        KvPushing(transfer_id=TID, prefill_id="p0", decode_id="d0", rank=1, tp=2),
    ),
    (
        subjects.kv_done("d0"),
        FirstToken(
            transfer_id=TID,
            prefill_id="p0",
            decode_id="d0",
            token_id=42,
            finish_reason=FinishReason.STOP,
            stop_reason="\n",
        ),
    ),
    (
        subjects.kv_failed("d0"),
        KvFailed(
            transfer_id=TID,
            prefill_id="p0",
            decode_id="d0",
            reason=FailReason.POST,
            detail="ucx said no",
        ),
    ),
    (
        subjects.tokens("gw0"),
        TokenChunk(
            request_id="cmpl-1",
            transfer_id=TID,
            seq=2,
            token_ids=[5],
            text="hi",
            finish_reason=FinishReason.STOP,
            usage=Usage(3, 1),
        ),
    ),
    (subjects.abort("d0"), Abort(transfer_id=TID, sender="gw0", reason="client left")),
    (subjects.abort("d0"), AbortAck(transfer_id=TID, prefill_id="p0")),
    (
        subjects.cache_events(WorkerRole.DECODE, "d0"),
        CacheEvents(
            worker_id="d0", epoch=1, seq=4, block_size=16, stored=[-(2**63), 2**63 - 1], removed=[3]
        ),
    ),
    (subjects.cache_sync(), CacheSync(sender="gw0", workers=["d0", "p0"])),
    (
        subjects.heartbeat(WorkerRole.DECODE, "d0"),
        WorkerHeartbeat(
            worker_id="d0",
            role=WorkerRole.DECODE,
            epoch=1,
            model="tiny",
            side_channel=ADDR,
            in_flight=0,
            queue_depth=0,
            free_blocks=10,
            total_blocks=10,
            sent_at_ms=1,
        ),
    ),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for _, m in SAMPLES} == set(ALL_MESSAGES)


@pytest.mark.parametrize(("subject", "message"), SAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_round_trips_on_its_subject(subject: str, message: object) -> None:
    payload = encode(message)  # type: ignore[arg-type]
    assert json.loads(payload)["type"] == f"kvpush.v1.{type(message).__name__}"
    assert decode(subject, payload) == message


def _error_kind(subject: str, payload: bytes) -> MessageErrorKind:
    with pytest.raises(MessageError) as info:
        decode(subject, payload)
    return info.value.kind


def _request_dict(**changes: object) -> dict:
    data = msgspec.to_builtins(SAMPLES[0][1])
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes",
    [
        {"prompt_token_ids": [-1]},
        {"prompt_token_ids": []},
        {"prompt_token_ids": [2**31]},
        {"prompt_token_ids": [1] * (MAX_PROMPT_TOKENS + 1)},
        {"transfer_id": "short"},
        {"request_id": "has space"},
        {"reply_subject": "kvpush.v1.tokens.*"},
        {"mode": "teleport"},
        {"deadline_ms": -5},
        {"sampling": {"temperature": 1000.5}},
        {"sampling": {"top_p": 0.0}},
        {"sampling": {"max_tokens": 0}},
        {"sampling": {"stop": ["x"] * 17}},
        {"sampling": {"unknown_knob": 1}},
        {"model": ""},
    ],
)
def test_out_of_bound_request_fields_are_rejected(changes: dict) -> None:
    payload = msgspec.json.encode(_request_dict(**changes))
    assert _error_kind(subjects.request("p0", "d0"), payload) is MessageErrorKind.MALFORMED


def test_errors_say_why() -> None:
    good = encode(SAMPLES[0][1])  # type: ignore[arg-type]
    request = subjects.request("p0", "d0")
    assert _error_kind("other.subject", good) is MessageErrorKind.SUBJECT
    assert _error_kind("kvpush.v1.req.p0", good) is MessageErrorKind.SUBJECT
    assert (
        _error_kind(request, good.replace(b"kvpush.v1.", b"kvpush.v2.")) is MessageErrorKind.VERSION
    )
    assert _error_kind(subjects.blocks("p0"), good) is MessageErrorKind.WRONG_TYPE
    assert _error_kind(subjects.request("p0", "d9"), good) is MessageErrorKind.MISMATCH
    assert _error_kind(request, b" " * (1024 * 1024 + 1)) is MessageErrorKind.TOO_LARGE
    assert _error_kind(request, b"\xff\xfe") is MessageErrorKind.MALFORMED
    heartbeat = encode(SAMPLES[-1][1])  # type: ignore[arg-type]
    wrong_role = subjects.heartbeat(WorkerRole.PREFILL, "d0")
    assert _error_kind(wrong_role, heartbeat) is MessageErrorKind.MISMATCH


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=512), index=st.integers(0, len(SAMPLES) - 1))
def test_random_bytes_raise_only_message_error(payload: bytes, index: int) -> None:
    subject = SAMPLES[index][0]
    try:
        decoded = decode(subject, payload)
    except MessageError as exc:  # the only exception decode may raise
        assert str(exc)
    else:
        assert decode(subject, encode(decoded)) == decoded


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(SAMPLES) - 1), field=st.integers(0, 30), value=_json)
def test_mutated_messages_decode_valid_or_raise_message_error(
    index: int, field: int, value: object
) -> None:
    subject, message = SAMPLES[index]
    data = msgspec.to_builtins(message)
    key = sorted(data)[field % len(data)]
    data[key] = value
    try:
        decoded = decode(subject, msgspec.json.encode(data))
    except MessageError:
        return
    # Whatever was accepted is a well-formed message of the subject's type, re-encodable.
    assert decode(subject, encode(decoded)) == decoded


@pytest.mark.parametrize("bad", ["", "a.b", "*", ">", "a b", "x" * 65, "é"])
def test_ids_that_could_widen_a_subscription_are_refused(bad: str) -> None:
    with pytest.raises(subjects.SubjectError):
        subjects.request(bad, "d0")


def test_subject_filters_match_the_contract() -> None:
    assert subjects.request("p0", "d0") == "kvpush.v1.req.p0.d0"
    assert subjects.requests_for_prefill("p0") == "kvpush.v1.req.p0.*"
    assert subjects.requests_for_decode("d0") == "kvpush.v1.req.*.d0"
    assert subjects.parse("kvpush.v1.kv.done.d0") == (subjects.SubjectKind.KV_DONE, ("d0",))
    assert subjects.heartbeats(WorkerRole.PREFILL) == "kvpush.v1.heartbeat.prefill.*"


def test_committed_contract_files_are_current() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpush.services.cli", "schemas", "export", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_export_check_detects_a_stale_file(tmp_path: Path) -> None:
    schema_export.write(tmp_path)
    assert schema_export.stale(tmp_path) == []
    target = tmp_path / "json" / "RequestEvent.json"
    target.write_text(target.read_text().replace("prompt_token_ids", "prompt_ids"))
    (tmp_path / "asyncapi.json").unlink()
    assert sorted(schema_export.stale(tmp_path)) == ["asyncapi.json", "json/RequestEvent.json"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpush.services.cli",
            "schemas",
            "export",
            "--check",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "RequestEvent.json" in result.stderr


def test_asyncapi_document_lists_every_subject_and_message() -> None:
    document = json.loads(schema_export.render()["asyncapi.json"])
    assert document["asyncapi"] == "3.0.0"
    addresses = {c["address"] for c in document["channels"].values()}
    assert "kvpush.v1.req.{prefill}.{decode}" in addresses
    assert "kvpush.v1.blocks.{prefill}" in addresses
    assert set(document["components"]["messages"]) == {m.__name__ for m in ALL_MESSAGES}
