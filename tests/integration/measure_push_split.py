"""Time split of single push (and pull) requests on the bench model: a measurement, not a test.

    .venv/bin/python -m tests.integration.measure_push_split [--tokens 2048] [--repeats 5]

Starts nats-server, the bench model's prefill engine (core 0) and decode engine (core 1) with
KVPushConnector, and for each repeat sends one fresh prompt to P and D at the same moment (as
the gateway does). An observer on the bus timestamps the announcement and KvPushed; the engines
report when P's request finished and when D produced its first token. Also measures D alone
(aggregated: one engine computes prompt + first token). Prints medians in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kvpush.schemas import BlocksAnnounced, KvPushed, KvReady, subjects
from kvpush.services import models
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvpush-split-"))
    model = models.build_model(models.BENCH, work / "bench")
    nats = EmbeddedNats()
    url = nats.start()
    prefill = start_engine(
        "P",
        model,
        P_CORES,
        work,
        max_model_len=4096,
        kv_transfer_config=connector_config("prefill", PREFILL_ID, url),
    )
    decode = start_engine(
        "D",
        model,
        D_CORES,
        work,
        max_model_len=4096,
        kv_transfer_config=connector_config("decode", DECODE_ID, url),
    )
    observer = Observer(url)
    rng = random.Random(0)
    rows: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value * 1000)

    def sampling(n: int) -> dict[str, Any]:
        return {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}

    try:
        for mode in ("push", "pull"):
            for _ in range(args.repeats + 1):  # the first round warms both engines up
                ids = [rng.randrange(10, 8000) for _ in range(args.tokens)]
                tid = f"tx-{uuid.uuid4().hex[:16]}"
                kv = {
                    "kvpush": {
                        "transfer_id": tid,
                        "prefill_id": PREFILL_ID,
                        "decode_id": DECODE_ID,
                        "mode": mode,
                    }
                }
                t0 = time.monotonic()
                prefill.submit(
                    [
                        {
                            "request_id": f"p-{tid}",
                            "prompt_token_ids": ids,
                            "sampling": sampling(1),
                            "kv_transfer_params": kv,
                        }
                    ]
                )
                decode.submit(
                    [
                        {
                            "request_id": f"d-{tid}",
                            "prompt_token_ids": ids,
                            "sampling": sampling(2),
                            "kv_transfer_params": kv,
                        }
                    ]
                )
                (d_out,) = decode.collect([f"d-{tid}"])
                (p_out,) = prefill.collect([f"p-{tid}"])
                if _ == 0:
                    continue
                assert d_out["error"] is None and p_out["error"] is None
                note(f"{mode}: D first token (TTFT)", d_out["first_output_s"])
                note(f"{mode}: P prefill done", p_out["total_s"])
                if mode == "push":
                    note("push: announcement on bus", observer.seen[("BlocksAnnounced", tid)] - t0)
                    note("push: KvPushed on bus", observer.seen[("KvPushed", tid)] - t0)
                    event = observer.pushed[tid]
                    note("push: posting -> last WRITE done", event.push_ms / 1000)
                    if event.layers:
                        tail = event.layers[-1].done_ms - event.layers[-1].posted_ms
                        note("push: last layer WRITE", tail / 1000)
                else:
                    note("pull: KvReady on bus", observer.seen[("KvReady", tid)] - t0)
            for i in range(args.repeats + 1):
                ids = [rng.randrange(10, 8000) for _ in range(args.tokens)]
                (out,) = decode.generate(
                    [
                        {
                            "request_id": f"agg-{mode}-{i}",
                            "prompt_token_ids": ids,
                            "sampling": sampling(2),
                        }
                    ]
                )
                if i:
                    note(f"aggregated ({mode} round): first token", out["first_output_s"])
    finally:
        prefill.stop()
        decode.stop()
        nats.stop()
    print(f"bench model, {args.tokens}-token prompts, median of {args.repeats} (ms):")
    for key, values in rows.items():
        print(f"  {key:<42} {statistics.median(values):8.1f}   (min {min(values):.1f})")
    _ = (BlocksAnnounced, KvReady)


if __name__ == "__main__":
    main()
