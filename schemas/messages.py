"""Every kvpush v1 bus message as a tagged ``msgspec.Struct``.

This module owns the *shape* of the public bus contract (docs/bus.md): field names, types and
bounds. Integrators subscribe to these subjects, so a change here is a protocol change: bump
``PROTOCOL_VERSION`` and record why in ``PROTOCOL_HISTORY``.

Wire format: JSON (UTF-8), one object per NATS message, with a ``type`` tag such as
``"kvpush.v1.RequestEvent"``. Bounds are enforced on decode by msgspec (C speed); see
``kvpush.schemas.codec`` for the single decode path.

Threading model: none. Structs are immutable (``frozen=True``) values, safe to share.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from kvpush.schemas.sampling import PositionLogprobs, SamplingSpec, SequenceOutput, TokenId

PROTOCOL_VERSION: Final = 1
PROTOCOL_HISTORY: Final = {
    1: "initial contract: request, blocks, kv.ready/done/failed, tokens, abort, heartbeat;"
    " optional ``timing`` (Timing) on KvReady, KvPushed and the last TokenChunk;"
    " optional ``rank`` and ``tp`` (the sender's tensor-parallel rank and size; absent: 0"
    " and 1) on BlocksAnnounced, KvReady, KvPushed, KvFailed, AbortAck and Abort (rank"
    " absent on Abort: every rank), optional ``side_channels`` (one per rank) on"
    " WorkerHeartbeat; KvPushing (P -> D: a push started) on the kv.done subject (a decoder"
    " older than it drops it as a wrong type: only its poll rate is lost); optional"
    " ``first_token_by`` on RequestEvent (absent: decode) and FirstToken (P -> D: the token P"
    " sampled, which D continues from) on the kv.done subject (an older prefill worker never"
    " sends it: D computes the token itself after ``first_token_wait_s``; an older decode"
    " worker ignores both and computes it as before); optional ``prefill_token`` on Timing and"
    " ``sends_first_token`` on WorkerHeartbeat (a gateway asks P for the first token only"
    " where its heartbeat says it sends one); SamplingSpec's every SamplingParams field of"
    " the OpenAI layer (n, penalties, min_p, logit_bias, logprobs, prompt_logprobs, bad_words,"
    " structured_outputs, ...: absent means vLLM's default) and optional ``outputs``"
    " (SequenceOutput per answer: logprobs, n > 1), ``prompt_logprobs`` and"
    " ``num_cached_tokens`` and ``stop_reason`` on TokenChunk; optional ``alloc_epoch`` (D's"
    " allocation id of the announced blocks, absent: 0, unknown) on BlocksAnnounced, echoed"
    " by P on KvPushed, KvFailed and AbortAck (D drops a word of another allocation), and"
    " optional ``checksums`` on KvReady (P's KV checksum of the announced blocks, one per equal"
    " byte part of a block; absent: not computed, D's READ is then unchecked);"
    " CacheEvents (a worker's prefix cache, on cache.<role>.<worker>) and CacheSync (a"
    " gateway asks for snapshots of them, on cache.sync); optional ``gpu`` on WorkerHeartbeat"
    " (the GPU its engine runs on; absent: none known, the router overlaps as before)",
}
TAG_PREFIX: Final = f"kvpush.v{PROTOCOL_VERSION}."

# ---- bounds --------------------------------------------------------------------------------
MAX_PROMPT_TOKENS: Final = 131_072
MAX_BLOCK_ID: Final = 2**31 - 1
MAX_BLOCK_RUNS: Final = 65_536
MAX_LAYERS: Final = 1024
MAX_TP: Final = 1024

WorkerId = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="worker id, one subject token")
]
TransferId = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9_-]{8,64}$", description="gateway-made transfer id")
]
RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
Subject = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", max_length=256)]
Address = Annotated[str, Meta(pattern=r"^tcp://[A-Za-z0-9.:\[\]-]{1,200}:[0-9]{1,5}$")]
CompatHash = Annotated[str, Meta(pattern=r"^[0-9a-f]{16,64}$")]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]
PromptTokenIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
Millis = Annotated[float, Meta(ge=0.0, le=1e12)]
UnixMillis = Annotated[int, Meta(ge=0, le=2**53)]
UnixNanos = Annotated[int, Meta(ge=0, le=2**63 - 1, description="unix time in ns; 0: not seen")]
ShortText = Annotated[str, Meta(max_length=1024)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
BlockRun = Annotated[
    tuple[
        Annotated[int, Meta(ge=0, le=MAX_BLOCK_ID)],
        Annotated[int, Meta(ge=1, le=MAX_BLOCK_ID)],
    ],
    Meta(description="run of consecutive block ids: [first_block_id, count]"),
]
BlockRuns = Annotated[list[BlockRun], Meta(max_length=MAX_BLOCK_RUNS)]
TpRank = Annotated[
    int,
    Meta(
        ge=0,
        lt=MAX_TP,
        description="tensor-parallel rank of the sender; with ``tp`` it names the slice of KV"
        " heads the sender holds (rank r of tp t: heads [r/t, (r+1)/t) of the model's)",
    ),
]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP, description="the sender's tensor-parallel size")]
AllocEpoch = Annotated[
    int,
    Meta(
        ge=0,
        le=2**53,
        description="decode's allocation id of the announced blocks (0: unknown, an older"
        " peer); prefill echoes it, and decode takes a word only for the allocation it waits on",
    ),
]
Checksum = Annotated[
    int,
    Meta(
        ge=-(2**63),
        le=2**63 - 1,
        description="KV checksum: over layer, region, block (in token order) the sum of each"
        " block's bytes read as signed integers of the KV element width, weighted by its"
        " position + 1, in wrap-around int64 (connector/integrity.py)",
    ),
]


class TransferMode(str, enum.Enum):
    """How KV reaches the decode worker."""

    PUSH = "push"  # P WRITEs into blocks D announced (kvpush's default)
    PULL = "pull"  # P announces its blocks when done, D READs them
    LOCAL = "local"  # no transfer: D prefills itself (short prompts)


class WorkerRole(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class FailReason(str, enum.Enum):
    """Why a transfer failed; D falls back to local prefill on any of these."""

    HANDSHAKE = "handshake"  # side channel / NIXL metadata exchange failed
    INCOMPATIBLE = "incompatible"  # compatibility hash mismatch
    POST = "post"  # posting a NIXL transfer failed
    TRANSFER = "transfer"  # a NIXL handle ended in error
    DEADLINE = "deadline"  # the transfer's deadline passed
    ABORTED = "aborted"  # aborted by the gateway or a peer
    PREFILL = "prefill"  # the prefill engine failed the request
    OVERLOADED = "overloaded"  # no free blocks / queue full
    SHUTDOWN = "shutdown"  # the worker is draining or stopping


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class _Message(msgspec.Struct, frozen=True, tag_field="type", tag=lambda name: TAG_PREFIX + name):
    """A bus message: its ``type`` tag is ``kvpush.v1.<class name>``."""


class RequestEvent(_Message):
    """gateway -> P and D in one publish on ``kvpush.v1.req.<prefill>.<decode>``."""

    transfer_id: TransferId
    request_id: RequestId
    prefill_id: WorkerId
    decode_id: WorkerId
    model: ModelName
    prompt_token_ids: PromptTokenIds
    reply_subject: Subject
    deadline_ms: UnixMillis
    sampling: SamplingSpec = SamplingSpec()
    mode: TransferMode = TransferMode.PUSH
    stream: bool = True
    # who samples the answer's first token: the decode worker (after the KV landed, one engine
    # step of its own) or the prefill worker, whose prefill samples it anyway (FirstToken: D
    # then starts from it, its first step computes the second token). Push and pull only.
    first_token_by: WorkerRole = WorkerRole.DECODE


class BlocksAnnounced(_Message):
    """D -> P on ``kvpush.v1.blocks.<prefill>``: where to WRITE the prompt's KV.

    ``first_token`` is the number of prompt tokens D already holds (prefix hit, block
    aligned); ``block_runs`` cover the blocks for tokens ``[first_token, num_tokens)`` only.
    """

    transfer_id: TransferId
    decode_id: WorkerId
    decode_epoch: Count
    block_runs: BlockRuns
    first_token: Count
    num_tokens: Count
    compat_hash: CompatHash
    side_channel: Address
    rank: TpRank = 0  # D's rank that owns these blocks
    tp: TpSize = 1
    alloc_epoch: AllocEpoch = 0  # the same on every rank of one allocation


class Timing(msgspec.Struct, frozen=True, omit_defaults=True):
    """Critical-path instants of one request (unix ns, 0 = not seen), in path order.

    Each service fills what it saw: the gateway ``arrived``/``published``/``first_byte``, P
    ``prefill_received``/``prefill_start``/``prefill_end`` (and ``kv_sent`` in push mode, the
    last WRITE done), D ``decode_received``/``kv_landed`` (pull: its READ done)/``first_token``,
    and ``prefill_token`` when D continued from the first token P sampled (0: D sampled it);
    ``kv_cached`` when D's own prefix cache held the prompt but for fewer tokens than a transfer
    is worth (``min_transfer_tokens``): D computed those and asked for no KV.
    ``kvpush.services.telemetry.breakdown`` turns them into the TTFT breakdown. Clocks of
    different hosts are compared as they are: keep them NTP-synced.
    """

    arrived: UnixNanos = 0
    published: UnixNanos = 0
    prefill_received: UnixNanos = 0
    prefill_start: UnixNanos = 0
    prefill_end: UnixNanos = 0
    kv_sent: UnixNanos = 0
    decode_received: UnixNanos = 0
    kv_landed: UnixNanos = 0
    prefill_token: UnixNanos = 0  # D took up P's FirstToken (the receive was reported with it)
    first_token: UnixNanos = 0
    first_byte: UnixNanos = 0
    kv_cached: UnixNanos = 0  # D's prefix cache held the prompt: no transfer was asked


class KvReady(_Message):
    """P -> D on ``kvpush.v1.kv.ready.<decode>`` in pull mode: P's blocks hold the KV; READ them."""

    transfer_id: TransferId
    prefill_id: WorkerId
    prefill_epoch: Count
    block_runs: BlockRuns
    num_tokens: Count
    compat_hash: CompatHash
    side_channel: Address
    timing: Timing | None = None  # P's prefill_received/start/end
    rank: TpRank = 0  # P's rank that computed these blocks
    tp: TpSize = 1
    # the KV checksum of every announced block, one per equal byte part of a block (a reader
    # of another TP sums the parts its slice covers); None: P computed none
    checksums: Annotated[list[Checksum], Meta(max_length=MAX_TP)] | None = None


class LayerTiming(msgspec.Struct, frozen=True, array_like=True):
    """Per-layer push timing: [layer index, ms after compute start when posted, ms when done]."""

    layer: Annotated[int, Meta(ge=0, le=MAX_LAYERS)]
    posted_ms: Millis
    done_ms: Millis


class KvPushed(_Message):
    """P -> D (and observers) on ``kvpush.v1.kv.done.<decode>`` after the last WRITE is done."""

    transfer_id: TransferId
    prefill_id: WorkerId
    decode_id: WorkerId
    bytes: Count
    descriptors: Count
    num_tokens: Count
    push_ms: Millis
    layers: Annotated[list[LayerTiming], Meta(max_length=MAX_LAYERS)] = []
    timing: Timing | None = None  # P's prefill_received/start/end and kv_sent
    rank: TpRank = 0  # the rank pair this push was
    tp: TpSize = 1
    alloc_epoch: AllocEpoch = 0  # the announcement's, echoed


class KvPushing(_Message):
    """P -> D on ``kvpush.v1.kv.done.<decode>``: P's WRITEs of a transfer started, so its end
    is near. D then polls for the completion notice at full rate (before: slowly, so a decode
    engine waiting for a long prefill costs almost no CPU); a lost hint costs latency only."""

    transfer_id: TransferId
    prefill_id: WorkerId
    decode_id: WorkerId
    rank: TpRank = 0
    tp: TpSize = 1


class FirstToken(_Message):
    """P -> D on ``kvpush.v1.kv.done.<decode>`` for a RequestEvent with ``first_token_by``
    prefill: the answer's first token, sampled by P's prefill with the request's sampling. D
    reports it as its own first output and continues the answer from it. ``finish_reason`` and
    ``stop_reason`` are how P's one-token request ended: ``stop`` when the token ends the answer
    (end of sequence or a stop token: ``stop_reason`` None or the token id; a stop string:
    ``stop_reason`` the string, D's detokenizer finds it too)."""

    transfer_id: TransferId
    prefill_id: WorkerId
    decode_id: WorkerId
    token_id: TokenId
    finish_reason: FinishReason | None = None
    stop_reason: TokenId | Annotated[str, Meta(max_length=256)] | None = None


class KvFailed(_Message):
    """P -> D (and observers) on ``kvpush.v1.kv.failed.<decode>``: D must fall back now."""

    transfer_id: TransferId
    prefill_id: WorkerId
    decode_id: WorkerId
    reason: FailReason
    detail: ShortText = ""
    rank: TpRank = 0
    tp: TpSize = 1
    alloc_epoch: AllocEpoch = 0  # the announcement's, echoed (0: none came)


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_tokens: Count
    completion_tokens: Count


class TokenChunk(_Message):
    """D -> gateway on ``kvpush.v1.tokens.<gateway>``; ``seq`` orders chunks of one request."""

    request_id: RequestId
    transfer_id: TransferId
    seq: Count
    token_ids: TokenIds = []
    text: Annotated[str, Meta(max_length=1_000_000)] = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ShortText | None = None
    timing: Timing | None = None  # the last chunk only: what D knows of the critical path
    # n > 1 or log-probabilities asked for: each answer's delta here (token_ids/text then
    # stay empty); absent: token_ids/text/finish_reason are answer 0's
    outputs: Annotated[list[SequenceOutput], Meta(max_length=128)] | None = None
    # the first chunk only, when asked for: one entry per prompt token (the first: None)
    prompt_logprobs: Annotated[list[PositionLogprobs | None], Meta(max_length=131_072)] | None = (
        None
    )
    num_cached_tokens: Count | None = None  # the last chunk: prompt tokens D did not compute
    # the last chunk of a "stop": the stop string or token id that ended the answer (with
    # ``outputs``: each SequenceOutput carries its own)
    stop_reason: int | Annotated[str, Meta(max_length=256)] | None = None


class Abort(_Message):
    """gateway -> P and D (or P -> D) on ``kvpush.v1.abort.<worker>``."""

    transfer_id: TransferId
    sender: WorkerId
    reason: ShortText = ""
    rank: TpRank | None = None  # the rank pair it ends; None: every rank
    tp: TpSize = 1


class AbortAck(_Message):
    """P -> D on ``kvpush.v1.abort.<decode>``: no WRITE of this transfer is in flight or to come."""

    transfer_id: TransferId
    prefill_id: WorkerId
    rank: TpRank = 0
    tp: TpSize = 1
    alloc_epoch: AllocEpoch = 0  # the announcement's, echoed (0: none came)


class WorkerHeartbeat(_Message):
    """workers -> gateway and observers on ``kvpush.v1.heartbeat.<role>.<worker>``."""

    worker_id: WorkerId
    role: WorkerRole
    epoch: Count
    model: ModelName
    side_channel: Address
    in_flight: Count
    queue_depth: Count
    free_blocks: Count
    total_blocks: Count
    sent_at_ms: UnixMillis
    draining: bool = False
    side_channels: Annotated[list[Address], Meta(max_length=MAX_TP)] = []  # by rank
    sends_first_token: bool = False  # a prefill worker that sends FirstToken when asked
    # the worker's lease: silent this long, it is gone (0: the watcher's default)
    lease_ms: Count = 0
    # the device its engine computes on: a GPU, "<host>/gpu<index>", or the cores a CPU engine
    # is pinned to, "<host>/cpu<c>[,<c>...]" ("": none known): engines on one device take turns
    # on its compute (the router does not overlap their prefills)
    gpu: Annotated[str, Meta(max_length=256)] = ""


MAX_CACHE_HASHES: Final = 4096  # stored + removed hashes of one CacheEvents message
PrefixHash = Annotated[
    int,
    Meta(
        ge=-(2**63),
        le=2**63 - 1,
        description="chained hash (int64) of a prompt prefix ending on a block boundary",
    ),
]
PrefixHashes = Annotated[list[PrefixHash], Meta(max_length=MAX_CACHE_HASHES)]


class CacheEvents(_Message):
    """worker -> gateways on ``kvpush.v1.cache.<role>.<worker>``: what the worker's prefix cache
    stored and dropped since its last message, as chained prefix hashes (schemas/prefix.py) of
    ``block_size``-token blocks. ``seq`` counts this worker's messages (per epoch, from 0): a
    gap means one was lost. ``cleared``: everything held before is gone (applied before
    ``stored``). ``snapshot``: part of an answer to CacheSync; its first message is ``cleared``
    and the following ``snapshot`` ones up to ``last`` list the rest of what the cache holds."""

    worker_id: WorkerId
    epoch: Count
    seq: Count
    block_size: Annotated[int, Meta(ge=0, le=2**20)]  # tokens per block; 0: none indexed yet
    stored: PrefixHashes = []
    removed: PrefixHashes = []
    cleared: bool = False
    snapshot: bool = False
    last: bool = True  # the last message of a snapshot (always True outside snapshots)


class CacheSync(_Message):
    """gateway -> workers on ``kvpush.v1.cache.sync``: send a snapshot of your prefix cache
    (CacheEvents with ``snapshot``) now; ``workers`` names who (empty: every worker)."""

    sender: WorkerId
    workers: Annotated[list[WorkerId], Meta(max_length=4096)] = []


# every bus message, in the order defined above
ALL_MESSAGES: Final[tuple[type[msgspec.Struct], ...]] = tuple(_Message.__subclasses__())
