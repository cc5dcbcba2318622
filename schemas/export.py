"""Generate the published contract files from the structs: JSON Schemas and AsyncAPI 3.0.

``render()`` returns {relative path: text}; ``write(dir)`` writes them; ``stale(dir)`` lists the
files whose committed text differs from what the structs generate (used by
``kvpush schemas export --check`` and a test). Output is deterministic (sorted keys).

Threading model: none (pure functions plus file writes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import msgspec

from kvpush.schemas import subjects
from kvpush.schemas.codec import CARRIES
from kvpush.schemas.messages import ALL_MESSAGES, PROTOCOL_VERSION
from kvpush.schemas.subjects import SubjectKind

PACKAGE_DIR: Final = Path(__file__).resolve().parent

# channel id -> (subject kind, its id tokens' descriptions, description); the address is the
# kind's subject with a parameter per id token, the messages those the kind carries (codec.py)
_CHANNELS: Final[dict[str, tuple[SubjectKind, dict[str, str], str]]] = {
    "request": (
        SubjectKind.REQUEST,
        {"prefill": "prefill worker id", "decode": "decode worker id"},
        "One publish reaches the prefill worker (req.<P>.*) and the decode worker (req.*.<D>).",
    ),
    "blocks": (
        SubjectKind.BLOCKS,
        {"prefill": "prefill worker id"},
        "Decode announces the blocks prefill must WRITE into (push mode).",
    ),
    "kvReady": (
        SubjectKind.KV_READY,
        {"decode": "decode worker id"},
        "Prefill announces its blocks for decode to READ (pull mode).",
    ),
    "kvDone": (
        SubjectKind.KV_DONE,
        {"decode": "decode worker id"},
        "Prefill started (KvPushing: decode polls for the end at full rate) and finished"
        " (KvPushed: observers, bookkeeping) pushing a transfer; the first token prefill"
        " sampled (FirstToken: decode continues the answer from it).",
    ),
    "kvFailed": (
        SubjectKind.KV_FAILED,
        {"decode": "decode worker id"},
        "A transfer failed: decode falls back to local prefill.",
    ),
    "tokens": (
        SubjectKind.TOKENS,
        {"gateway": "gateway id"},
        "Decode streams generated tokens to the gateway that owns the request.",
    ),
    "abort": (
        SubjectKind.ABORT,
        {"worker": "worker id"},
        "Aborts (gateway -> workers) and abort acknowledgements (prefill -> decode).",
    ),
    "heartbeat": (
        SubjectKind.HEARTBEAT,
        {"role": "prefill or decode", "worker": "worker id"},
        "Worker liveness, load and free blocks; the gateway routes on these.",
    ),
    "cacheEvents": (
        SubjectKind.CACHE,
        {"role": "prefill or decode", "worker": "worker id"},
        "What a worker's prefix cache stored and dropped (vLLM's KV cache events as chained"
        " prefix hashes), and its snapshots; the gateway's prefix index is built from these.",
    ),
    "cacheSync": (
        SubjectKind.CACHE_SYNC,
        {},
        "A gateway asks workers for snapshots of their prefix caches (at its start, after a gap).",
    ),
}


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def render() -> dict[str, str]:
    """Every generated file, keyed by path relative to the schemas package."""
    files: dict[str, str] = {}
    for message in ALL_MESSAGES:
        schema = msgspec.json.schema(message)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"urn:kvpush:v{PROTOCOL_VERSION}:{message.__name__}"
        files[f"json/{message.__name__}.json"] = _dump(schema)
    files["asyncapi.json"] = _dump(_asyncapi())
    return files


def _asyncapi() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        ALL_MESSAGES, ref_template="#/components/schemas/{name}"
    )
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for channel_id, (kind, params, description) in _CHANNELS.items():
        tokens = "".join(f".{{{name}}}" for name in params)
        channels[channel_id] = {
            "address": f"{subjects.ROOT}.{kind.value}{tokens}",
            "description": description,
            "parameters": {name: {"description": text} for name, text in params.items()},
            "messages": {
                m.__name__: {"$ref": f"#/components/messages/{m.__name__}"} for m in CARRIES[kind]
            },
        }
        operations[f"publish_{channel_id}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "kvpush bus contract",
            "version": f"{PROTOCOL_VERSION}.0.0",
            "description": (
                "Subjects and messages of kvpush (prefill pushes KV into blocks decode announced). "
                "JSON payloads; each carries a 'type' tag. Trace context travels in the W3C "
                "'traceparent' NATS header."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": components,
            "messages": {
                m.__name__: {
                    "name": m.__name__,
                    "summary": (m.__doc__ or "").strip().splitlines()[0],
                    "payload": {"$ref": f"#/components/schemas/{m.__name__}"},
                    "headers": {
                        "type": "object",
                        "properties": {"traceparent": {"type": "string"}},
                    },
                }
                for m in ALL_MESSAGES
            },
        },
    }


def write(out_dir: Path = PACKAGE_DIR) -> list[Path]:
    written = []
    for rel, text in render().items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale(out_dir: Path = PACKAGE_DIR) -> list[str]:
    """Relative paths whose file is missing or differs from what the structs generate."""
    result = []
    for rel, text in render().items():
        path = out_dir / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            result.append(rel)
    return result
