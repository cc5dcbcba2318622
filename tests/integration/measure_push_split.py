"""Time split of single push (and pull) requests on the bench model: a measurement, not a test.

    .venv/bin/python -m tests.integration.measure_push_split [--tokens 2048] [--repeats 5] \
        [--json docs/benchmarks/push-split.json]
    .venv/bin/python -m tests.integration.measure_push_split --report FILE.json [--doc MD] [--check]

Starts nats-server, the bench model's prefill engine (core 0) and decode engine (core 1) with
KVPushConnector, and for each repeat sends one fresh prompt to P and D at the same moment (as
the gateway does). An observer on the bus timestamps the announcement, KvPushed and KvReady;
the engines report when P's request output was finished and when D produced its first token.
Every instant is on one clock (``time.monotonic``, shared by the processes of one host) and
counted from the moment both legs were sent. Also measures D alone (aggregated: one engine
computes prompt + first token). ``--json`` keeps every repeat's instants; ``--report`` makes the
table (medians per event, and per repeat the order of P's finished output and its bus event)
that docs/connector.md carries in a generated section (``kvpush.benchmarks.
push_split_report``).

Threading model: the main thread drives the engines (child processes) one request at a time;
the bus observer runs its own asyncio loop on a daemon thread and only writes its dicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen, push_split_report
from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas import KvPushed, subjects
from kvpush.services import models
from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import DECODE_ID, PREFILL_ID, connector_config
from tests.integration.engine_proc import D_CORES, P_CORES, start_engine


class Observer:
    """Timestamps (time.monotonic) of bus events per transfer id, from its own thread."""

    def __init__(self, url: str) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self.pushed: dict[str, KvPushed] = {}
        ready = threading.Event()

        async def run() -> None:
            bus = await Bus.connect(BusConfig(url=url, name="observer"))
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()

            async def on(subject: str, message: Any) -> None:
                self.seen[(type(message).__name__, message.transfer_id)] = time.monotonic()
                if isinstance(message, KvPushed):
                    self.pushed[message.transfer_id] = message

            await bus.subscribe(subjects.blocks(PREFILL_ID), on)
            await bus.subscribe(subjects.kv_events(DECODE_ID), on)
            await bus.flush()
            ready.set()
            await self._stop.wait()
            await bus.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def instant(self, kind: str, transfer_id: str, timeout_s: float = 30.0) -> float:
        """When ``kind`` of the transfer was seen (it may arrive just after the engines' reply)."""
        deadline = time.monotonic() + timeout_s
        while (kind, transfer_id) not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} for {transfer_id} on the bus")
            time.sleep(0.005)
        return self.seen[(kind, transfer_id)]

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _request(rid: str, ids: list[int], max_tokens: int, kv: Any = None) -> dict[str, Any]:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {
        "request_id": rid,
        "prompt_token_ids": ids,
        "sampling": sampling,
        "kv_transfer_params": kv,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="OUT", help="write every repeat's instants here")
    parser.add_argument("--report", metavar="JSON", help="run nothing: the table of a --json run")
    parser.add_argument("--doc", metavar="MD", help="with --report: write it into MD's section")
    parser.add_argument("--check", action="store_true", help="with --doc: only compare")
    args = parser.parse_args()
    if args.report:
        return push_split_report.report(Path(args.report), args.doc, args.check)
    with tempfile.TemporaryDirectory(prefix="kvpush-split-") as work, EmbeddedNats() as nats:
        repeats = _measure(Path(work), nats.url, args.tokens, args.repeats)
    meta = {
        "date": docgen.stamp(),
        "kvpush_rev": docgen.revision(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "model": models.BENCH.name,
    }
    document = {"meta": meta, "repeats": repeats}
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    print(push_split_report.table(document))
    return 0


def _measure(work: Path, url: str, tokens: int, repeat_count: int) -> list[dict[str, Any]]:
    """Every repeat's instants (push and pull), then D alone; engines and observer closed."""
    model = models.build_model(models.BENCH, work / "bench")
    engines: list[Any] = []
    observer: Observer | None = None
    repeats: list[dict[str, Any]] = []
    try:
        for name, cores, role, worker_id in (
            ("P", P_CORES, "prefill", PREFILL_ID),
            ("D", D_CORES, "decode", DECODE_ID),
        ):
            config = connector_config(role, worker_id, url)
            engines.append(
                start_engine(
                    name, model, cores, work, max_model_len=4096, kv_transfer_config=config
                )
            )
        prefill, decode = engines
        observer = Observer(url)
        rng = random.Random(0)
        for mode in ("push", "pull"):
            for i in range(repeat_count + 1):  # the first round warms both engines up
                ids = [rng.randrange(10, 8000) for _ in range(tokens)]
                tid = f"tx-{uuid.uuid4().hex[:16]}"
                kv = {"kvpush": {"transfer_id": tid, "prefill_id": PREFILL_ID,
                                 "decode_id": DECODE_ID, "mode": mode}}  # fmt: skip
                t0 = time.monotonic()
                prefill.submit([_request(f"p-{tid}", ids, 1, kv)])
                decode.submit([_request(f"d-{tid}", ids, 2, kv)])
                (d_out,) = decode.collect([f"d-{tid}"])
                (p_out,) = prefill.collect([f"p-{tid}"])
                assert d_out["error"] is None and p_out["error"] is None
                assert d_out["kv_landed_ns"] > 0, d_out  # D used the moved KV
                if i == 0:
                    continue
                kind = "KvPushed" if mode == "push" else "KvReady"
                events = {
                    "prefill_finished": p_out["submitted_at"] + p_out["total_s"] - t0,
                    "bus_event": observer.instant(kind, tid) - t0,
                    "first_token": d_out["submitted_at"] + d_out["first_output_s"] - t0,
                }
                row: dict[str, Any] = {"mode": mode, "last_layer_write_ms": None}
                if mode == "push":
                    events["announced"] = observer.instant("BlocksAnnounced", tid) - t0
                    layers = observer.pushed[tid].layers
                    if layers:
                        row["last_layer_write_ms"] = layers[-1].done_ms - layers[-1].posted_ms
                row["events_ms"] = {k: round(v * 1000, 3) for k, v in events.items()}
                repeats.append(row)
            for i in range(repeat_count + 1):
                ids = [rng.randrange(10, 8000) for _ in range(tokens)]
                (out,) = decode.generate([_request(f"agg-{mode}-{i}", ids, 2)])
                if i:
                    first_ms = round(out["first_output_s"] * 1000, 3)
                    repeats.append({"mode": "aggregated", "events_ms": {"first_token": first_ms}})
    finally:
        if observer is not None:
            observer.close()
        for engine in engines:
            engine.stop()
    return repeats


if __name__ == "__main__":
    sys.exit(main())
