"""The results document of ``kvpush bench serve`` (``results.json``), as typed structures.

``run.py`` writes it, ``report.py`` / ``summary.py`` read it (``load``: the JSON decoded and
checked against these structs). One ``Point`` per (system, table, point, repeat):

- identity: ``system``, ``dataset``, ``input_len``, ``point`` (the seed-giving id: ``0.25x``,
  ``qps 1.5``, ``c=4``), ``label`` (what tables show: ``qps 1.31``, ``c=4``), ``load_kind``
  (``qps`` / ``concurrency``), ``load`` (the plots' x), ``capacity_fraction``, ``repeat``
  (0-based), ``seed``, ``requests``;
- the numbers of ``loadgen.summarize`` (times in ms): ``completed``, ``errors``, ``ttft_ms``,
  ``tpot_ms``, ``itl_ms``, ``e2e_ms`` (mean/p50/p99 each), throughputs, ``wall_s``,
  ``output_digests`` (per request in order, a digest of its completion: token identity);
- ``breakdown`` (kvpush systems: per TTFT part mean/p50/p99, from the gateway);
- ``routing`` (kvpush systems: how the gateway routed the point's requests, from its
  ``/dashboard/data``, ``gateway_rows.routing_of``; keys sorted, ms and tokens to 3 decimals):
  ``requests`` (rows read: at most the gateway's last 200; ``of``: the requests completed,
  present only when fewer rows were read, ``ring_partial``), ``groups`` per
  ``<mode>/<route_reason>`` (``push/cost``, ``local/cold``, ``push/least-loaded``, ...; ``-``
  where the gateway named none) its ``count``, ``ttft_p50_ms`` (requests served OK),
  ``estimate_p50_ms`` (the cost model's estimated TTFT of its choice: the ``routed`` policy
  only) and ``decode_prefix_p50`` (prefix tokens the index said D held), each null without a
  value, and ``decode``: requests per decode worker id;
- ``transfer_check`` (``checks.py``): ``applies`` (false: one engine), ``ok``, ``checked``
  (requests verified), ``without_transfer`` (requests served without a KV transfer, or not
  verifiable), ``detail`` and the raw ``counts`` it was computed from.

Next to the points: ``meta`` (date, revision, versions, argv, plan, ``kvpush_env``: the
``KVPUSH_*`` settings kvpush's systems inherited from the bench's environment), ``systems``
(per system its runs: repeat, ok, start seconds, error), ``capacity`` (per input length: the
probed prefill capacity and on which system), ``rates_by_len``. ``ratios`` and ``verdicts``
are derived from the points when the run ends, for readers of the JSON; ``kvpush bench
report`` recomputes them.
Documents of the first format (no ``point``/``repeat``/``transfer_check``) and those written
before ``routing`` load too.

Threading model: pure functions and msgspec structs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

SCHEMA = 2


class Stats(msgspec.Struct):
    mean: float | None = None
    p50: float | None = None
    p99: float | None = None


class TransferCheck(msgspec.Struct, kw_only=True):
    applies: bool
    ok: bool
    checked: int = 0
    without_transfer: int = 0
    detail: str = ""
    counts: dict[str, float] = msgspec.field(default_factory=dict)


NOT_APPLICABLE = TransferCheck(applies=False, ok=True, detail="n/a: one engine, no transfer")


class Point(msgspec.Struct, kw_only=True):
    system: str
    dataset: str
    input_len: int
    point: str = ""  # empty in first-format documents: the label is the id there
    label: str
    load_kind: str
    load: float
    capacity_fraction: float | None = None
    repeat: int = 0
    seed: int = 0
    requests: int
    start_s: float | None = None
    completed: int
    errors: int
    error_samples: list[str] = msgspec.field(default_factory=list)
    wall_s: float = 0.0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    ttft_ms: Stats = msgspec.field(default_factory=Stats)
    tpot_ms: Stats = msgspec.field(default_factory=Stats)
    itl_ms: Stats = msgspec.field(default_factory=Stats)
    e2e_ms: Stats = msgspec.field(default_factory=Stats)
    breakdown: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None  # see the module docstring; absent: not recorded
    transfer_check: TransferCheck | None = None
    output_digests: list[str] = msgspec.field(default_factory=list)  # per request, "" failed
    first_token_by: str = ""  # "prefill": P sampled the first token (kvpush, --first-token)

    def __post_init__(self) -> None:
        if not self.point:
            self.point = self.label


# KVPUSH_* variables not recorded: the revision stamp (meta's kvpush_rev), the routing the
# bench sets per system, paths (where, not how), and what may hold a secret (KVPUSH_NATS_TOKEN,
# KVPUSH_API_KEYS, KVPUSH_NATS_TLS_KEY, a URL's user and password); KVPUSH_FIRST_TOKEN is none
_NOT_SETTINGS = re.compile(
    r"^KVPUSH_(REVISION|ROUTING)$|_(CACHE|DIR|FILE)$"
    r"|_(TOKEN|PASSWORD|SECRET|CREDS|NKEY|KEY|KEYS|USER|URL)(_|$)"
)
_SETTINGS = frozenset({"KVPUSH_FIRST_TOKEN"})
# the value of a flag in a flag list (KVPUSH_ENGINE_ARG, KVPUSH_VLLM_ARGS) that may be a secret:
# `--hf-token=...`, `--api-key ...`
_SECRET_FLAG = re.compile(
    r"(--(?:\w+-)*(?:token|keys?|keyfile|password|secret|creds?)(?:-\w+)*)([= ,]+)[^\s,]+",
    re.I,
)


def kvpush_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``KVPUSH_*`` variables of ``environ`` (sorted, empty ones left out): ``kvpush up``
    and its workers and gateway read their settings from them, so a run's kvpush systems ran
    with these (``KVPUSH_SERIAL_PREFILL_TOKENS=512``, ``KVPUSH_ENGINE_ARG=--block-size=16``).
    A secret flag's value in a flag list is recorded as ``***``."""
    return {
        name: _SECRET_FLAG.sub(r"\1\2***", value)
        for name, value in sorted(environ.items())
        if name.startswith("KVPUSH_")
        and value
        and (name in _SETTINGS or not _NOT_SETTINGS.search(name))
    }


def environment_text(env: Mapping[str, str] | None) -> str:
    """``kvpush_env`` as a report says it ("" for none)."""
    return ", ".join(f"`{name}={value}`" for name, value in (env or {}).items())


def part_environment_text(env: Mapping[str, str] | None) -> str:
    """A joined part's ``kvpush_env``: none given, or not recorded (a run before the key)."""
    if env is None:
        return "not recorded"
    return environment_text(env) or "no KVPUSH_* setting"


GIVEN = "given (--capacity)"  # Capacity.probed_on of a capacity given, not probed


class Capacity(msgspec.Struct, kw_only=True):
    req_s: float
    probe_ttft_ms: list[float] = msgspec.field(default_factory=list)
    probed_on: str = ""


class Document(msgspec.Struct, kw_only=True):
    schema: int = 1
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    systems: dict[str, Any] = msgspec.field(default_factory=dict)
    capacity: dict[str, Capacity] = msgspec.field(default_factory=dict)
    rates_by_len: dict[str, list[float]] = msgspec.field(default_factory=dict)
    points: list[Point] = msgspec.field(default_factory=list)
    ratios: list[dict[str, Any]] = msgspec.field(default_factory=list)
    verdicts: list[dict[str, Any]] = msgspec.field(default_factory=list)


def ring_partial(summary: dict[str, Any] | None) -> str:
    """ "N of M" when a point's ``breakdown`` or ``routing`` read fewer gateway rows than the
    point completed (its ``of``: the gateway's ring held only the last ones), else ""."""
    if not summary or "of" not in summary:
        return ""
    return f"{summary.get('requests', 0)} of {summary['of']}"


def point(row: dict[str, Any]) -> Point:
    """A point from the plain dict ``run.py`` assembles (type-checked)."""
    return msgspec.convert(row, Point)


def loads(text: str | bytes) -> Document:
    return msgspec.json.decode(text, type=Document)


def load(path: Path) -> Document:
    return loads(path.read_bytes())


def dumps(document: Document) -> str:
    """Indented JSON (one key per line: diffs of committed results stay readable)."""
    import json

    return json.dumps(msgspec.to_builtins(document), indent=1) + "\n"
