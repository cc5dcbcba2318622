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
that docs/connector.md carries in a generated section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvpush.schemas import KvPushed, subjects
from kvpush.services import models
from kvpush.services.bench import docgen
from kvpush.services.bus import Bus, BusConfig
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

            async def on(subject: str, message: Any) -> None:
                self.seen[(type(message).__name__, message.transfer_id)] = time.monotonic()
                if isinstance(message, KvPushed):
                    self.pushed[message.transfer_id] = message

            await bus.subscribe(subjects.blocks(PREFILL_ID), on)
            await bus.subscribe(subjects.kv_events(DECODE_ID), on)
            await bus.flush()
            ready.set()
            while True:
                await asyncio.sleep(3600)

        threading.Thread(target=lambda: asyncio.run(run()), daemon=True).start()
        assert ready.wait(10)


EVENTS = {  # mode -> (event key, row label) in path order
    "push": (
        ("announced", "D's announcement on the bus"),
        ("prefill_finished", "P's prefill output finished"),
        ("bus_event", "KvPushed on the bus"),
        ("first_token", "D's first token (TTFT)"),
    ),
    "pull": (
        ("prefill_finished", "P's prefill output finished"),
        ("bus_event", "KvReady on the bus"),
        ("first_token", "D's first token (TTFT)"),
    ),
    "aggregated": (("first_token", "D's first token (TTFT)"),),
}
REPORT_COMMAND = (
    "python -m tests.integration.measure_push_split --report docs/benchmarks/push-split.json "
    "--doc docs/connector.md"
)


def table(document: dict[str, Any]) -> str:
    """Medians (ms from both legs sent) per event and mode; the push tail; and how often P's
    bus event (KvPushed / KvReady) came before P's finished output in the same repeat."""
    runs = document["repeats"]

    def median(mode: str, key: str) -> str:
        values = [r["events_ms"][key] for r in runs if r["mode"] == mode and key in r["events_ms"]]
        return f"{statistics.median(values):.1f}" if values else "-"

    labels = {label: key for events in EVENTS.values() for key, label in events}
    lines = ["| event | push | pull | aggregated (one engine) |", "|---|---|---|---|"]
    for label, key in labels.items():
        cells = [median(mode, key) if (key, label) in EVENTS[mode] else "-" for mode in EVENTS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tails = [r["last_layer_write_ms"] for r in runs if r.get("last_layer_write_ms") is not None]
    lines.append(
        "| last layer's WRITE (posted -> done) | "
        + (f"{statistics.median(tails):.2f}" if tails else "-")
        + " | - | - |"
    )
    order = ["", "Per repeat, P's bus event against P's finished output (ms, event - output):", ""]
    order += ["| mode | repeats | event first | median difference | min | max |"]
    order += ["|---|---|---|---|---|---|"]
    for mode in ("push", "pull"):
        diffs = [
            r["events_ms"]["bus_event"] - r["events_ms"]["prefill_finished"]
            for r in runs
            if r["mode"] == mode
        ]
        if diffs:
            early = sum(d < 0 for d in diffs)
            order.append(
                f"| {mode} | {len(diffs)} | {early} | {statistics.median(diffs):.1f} | "
                f"{min(diffs):.1f} | {max(diffs):.1f} |"
            )
    meta = document["meta"]
    caption = (
        f"Bench model, {meta['tokens']}-token prompts, {meta['repeats']} repeats per mode "
        f"({meta['date']}, commit {meta['kvpush_rev']}); ms from the moment both legs were sent, "
        "median over the repeats ([data](benchmarks/push-split.json)):"
    )
    return "\n".join([caption, "", *lines, *order])


def report(path: Path, doc: str | None, check: bool) -> int:
    body = table(json.loads(path.read_text()))
    if not doc:
        print(body)
        return 0
    try:
        changed = docgen.update(Path(doc), "push-split", body, REPORT_COMMAND, check)
    except docgen.DocOutOfDate as exc:
        print(exc)
        return 1
    print(f"{doc}: {'updated' if changed else 'up to date'}")
    return 0


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
        return report(Path(args.report), args.doc, args.check)
    work = Path(tempfile.mkdtemp(prefix="kvpush-split-"))
    model = models.build_model(models.BENCH, work / "bench")
    nats = EmbeddedNats()
    url = nats.start()
    engines = [
        start_engine(
            name,
            model,
            cores,
            work,
            max_model_len=4096,
            kv_transfer_config=connector_config(role, worker_id, url),
        )
        for name, cores, role, worker_id in (
            ("P", P_CORES, "prefill", PREFILL_ID),
            ("D", D_CORES, "decode", DECODE_ID),
        )
    ]
    prefill, decode = engines
    observer = Observer(url)
    rng = random.Random(0)
    repeats: list[dict[str, Any]] = []
    try:
        for mode in ("push", "pull"):
            for i in range(args.repeats + 1):  # the first round warms both engines up
                ids = [rng.randrange(10, 8000) for _ in range(args.tokens)]
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
                    "bus_event": observer.seen[(kind, tid)] - t0,
                    "first_token": d_out["submitted_at"] + d_out["first_output_s"] - t0,
                }
                row: dict[str, Any] = {"mode": mode, "last_layer_write_ms": None}
                if mode == "push":
                    events["announced"] = observer.seen[("BlocksAnnounced", tid)] - t0
                    layers = observer.pushed[tid].layers
                    if layers:
                        row["last_layer_write_ms"] = layers[-1].done_ms - layers[-1].posted_ms
                row["events_ms"] = {k: round(v * 1000, 3) for k, v in events.items()}
                repeats.append(row)
            for i in range(args.repeats + 1):
                ids = [rng.randrange(10, 8000) for _ in range(args.tokens)]
                (out,) = decode.generate([_request(f"agg-{mode}-{i}", ids, 2)])
                if i:
                    first_ms = round(out["first_output_s"] * 1000, 3)
                    repeats.append({"mode": "aggregated", "events_ms": {"first_token": first_ms}})
    finally:
        for engine in engines:
            engine.stop()
        nats.stop()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "kvpush_rev": docgen.revision(),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "model": models.BENCH.name,
    }
    document = {"meta": meta, "repeats": repeats}
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    print(table(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
