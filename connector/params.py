"""Values of the vLLM adapter that carry no vLLM type: per-request parameters, settings, work.

- ``TransferParams``: what a request carries in ``kv_transfer_params["kvpush"]`` (set by the
  worker service): mode, transfer id, the two worker ids, deadline, trace context.
- ``timing_of``: the ``Timing`` a decode request's final ``kv_transfer_params`` carries.
- ``ConnectorSettings``: the engine's ``kv_connector_extra_config`` (worker id, role, NATS URL,
  side-channel host, timeouts, the KV checksum).
- ``PrefillWork`` / ``DecodeWork``: one request's share of a step, as the scheduler half hands
  it to the worker half inside ``metadata.KVPushMetadata`` (pickled when the worker runs in
  another process, so these are msgspec structs).
- ``PrefillToken``: the first token P sampled, from the decode side up to the engine's driver.

vLLM-free, so the worker service and the gateway import it without loading vLLM.

Threading model: none (values).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from kvpush.connector.bus import DEFAULT_NATS_URL
from kvpush.schemas.messages import Timing, TransferMode, WorkerRole

PARAMS_KEY = "kvpush"
TIMING_KEY = "kvpush_timing"  # on a decode request's final output: what the connector learned
INTEGRITY_KEY = "kvpush_integrity"  # ... and its receive's KV integrity outcome, with the counts


class TransferParams(msgspec.Struct, frozen=True):
    transfer_id: str
    prefill_id: str
    decode_id: str
    mode: TransferMode = TransferMode.PUSH
    deadline_ms: int = 0  # unix ms; 0: the connector's transfer_timeout_s from now
    traceparent: str | None = None
    prefill_address: str | None = None  # P's side channel (from its heartbeat): liveness probe
    prefill_addresses: list[str] = []  # with TP: every rank's, by rank (rank 0's is the above)
    received_ns: int = 0  # unix ns the worker got the RequestEvent (queue spans start here)
    # decode: P samples the first token (FirstToken); the receive ends once the KV landed and
    # that token came (or ``first_token_wait_s`` after the KV: then D samples it itself)
    first_token_from_prefill: bool = False

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` dict to put on a request."""
        return {PARAMS_KEY: msgspec.to_builtins(self)}

    def prefill_address_of(self, rank: int, tp: int) -> str | None:
        """The side channel of the (first) P rank that writes to D's rank ``rank`` of ``tp``."""
        if not self.prefill_addresses:
            return self.prefill_address
        ranks = len(self.prefill_addresses)
        return self.prefill_addresses[min(ranks - 1, rank * ranks // tp)]

    def timeout_s(self, default_s: float) -> float:
        if not self.deadline_ms:
            return default_s
        return max(0.05, self.deadline_ms / 1000.0 - time.time())


def read_params(kv_transfer_params: dict[str, Any] | None) -> TransferParams | None:
    """The request's kvpush parameters, or None for a request that runs like a normal one."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    try:
        params = msgspec.convert(kv_transfer_params[PARAMS_KEY], TransferParams)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"invalid kv_transfer_params.{PARAMS_KEY}: {exc}") from None
    return None if params.mode is TransferMode.LOCAL else params


def timing_of(kv_transfer_params: dict[str, Any] | None) -> Timing | None:
    """The critical-path instants the decode connector put on a request's final output."""
    raw = (kv_transfer_params or {}).get(TIMING_KEY)
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, Timing)
    except (msgspec.ValidationError, TypeError):
        return None


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str
    role: WorkerRole
    nats_url: str = DEFAULT_NATS_URL
    model_id: str = ""  # part of the compatibility hash; defaults to the served model name
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str | None = None
    transfer_timeout_s: float = 30.0  # a transfer without deadline_ms gets this long
    abort_ack_timeout_s: float = 2.0  # D waits this long for P's AbortAck before probing P
    # a P whose side channel listens but does not answer (stopped, hung) is presumed dead only
    # after this long: until then D keeps the blocks P may still write (probes.py)
    peer_silent_dead_s: float = 30.0
    min_transfer_tokens: int = 2  # prompts shorter than this are computed locally on D
    # decode: a prompt D computes itself that lacks this many tokens or more in its prefix
    # cache waits for the next step when the step has one already (0: vLLM's batching, kvpush's
    # workers' default too: services/workers/config.py)
    serial_prefill_tokens: int = 0
    ucx_error_handling_mode: str = "none"
    max_pending_announcements: int = 4096
    first_token_wait_s: float = 2.0  # decode: after the KV landed, how long to wait for P's
    # FirstToken before sampling the first token itself (an older or failing prefill worker)
    kv_checksum: bool = True  # P computes the moved KV's checksum, D verifies it before the
    # request runs (a mismatch: D computes the prompt itself); off: neither (integrity.py)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        try:
            return msgspec.convert(dict(extra or {}), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(
                f"kvpush connector: invalid kv_connector_extra_config: {exc}"
            ) from None


class PrefillToken(msgspec.Struct, frozen=True):
    """The first token P sampled for a decode request (``FirstToken``), on its way from the
    decode side to the engine's driver. Up to the scheduler half ``finish_reason`` is P's
    ("stop": the token ends the answer); the scheduler half makes it the answer's end on D:
    "stop" or "length" (the driver reports the token as the final output and ends the
    request), or None (the request continues from the token; a ``stop_reason`` string stays:
    D's detokenizer ends the answer on it)."""

    token_id: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def samples_on_prefill(sampling: Any) -> bool:
    """Does a first token sampled by P give the answer one engine gives, for ``sampling`` (a
    ``SamplingSpec`` or vLLM's ``SamplingParams``: the same field names; a field one of them
    lacks reads as its default)? D continues from P's token as from a prompt token, so not
    where sampling depends on what was sampled before: log-probabilities asked for (P's token
    carries none; the prompt's need D's own prefill), ``n`` > 1 (D fans the answers out),
    seeded random sampling (D's generator, seeded afresh, would draw the second token as one
    engine draws the first), presence or frequency penalties, ``min_tokens`` and bad words
    (they count the answer's tokens), a grammar or allowed tokens (the answer's state)."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(sampling, name, default)

    seeded = bool(get("temperature", 1.0)) and get("seed") is not None
    counted = ("presence_penalty", "frequency_penalty", "min_tokens", "bad_words")
    asked = ("structured_outputs", "allowed_token_ids", "logprobs", "prompt_logprobs")
    return (
        (get("n") or 1) == 1
        and not seeded
        and not any(get(name) for name in counted)
        and all(get(name) is None for name in asked)
    )


def first_token_end(
    token: PrefillToken, max_tokens: int, num_tokens: int, max_model_len: int
) -> PrefillToken:
    """How a decode request's answer ends with P's first token (vLLM's stop check of a first
    output token, from P's): "stop" for an end of sequence or a stop token (P's own check),
    "length" for a one-token answer or a context the token fills, else None: the request goes
    on from the token, and a stop string P saw in it stays for D's detokenizer to find."""
    if token.finish_reason == "stop" and not isinstance(token.stop_reason, str):
        return PrefillToken(token.token_id, "stop", token.stop_reason)
    if max_tokens <= 1 or num_tokens + 1 >= max_model_len:
        return PrefillToken(token.token_id, "length")
    return PrefillToken(token.token_id, None, token.stop_reason)


class PrefillWork(msgspec.Struct, frozen=True):
    """P: a request of this step; ``completes`` when this step computes its last prompt token."""

    req_id: str
    params: TransferParams
    block_ids: list[int]
    num_tokens: int
    completes: bool


class ReceiveKind(str, enum.Enum):
    PUSH = "push"  # expect WRITEs into block_ids, announce them
    PULL = "pull"  # READ P's blocks into block_ids once KvReady arrives
    LOCAL = "local"  # no transfer: tell P to drop its side
    ABORT = "abort"  # the request ended while its receive was in flight


class DecodeWork(msgspec.Struct, frozen=True):
    kind: ReceiveKind
    req_id: str
    params: TransferParams
    block_ids: list[int] = []
    first_token: int = 0
    num_tokens: int = 0
    allocated_ns: int = 0  # unix ns the scheduler allocated the blocks
    alloc_epoch: int = 0  # this allocation's id (every rank the same): announced, echoed by P
