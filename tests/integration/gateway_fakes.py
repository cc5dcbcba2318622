"""Gateway test harness: fake prefill/decode workers on the real nats-server, HTTP helpers.

A ``FakeWorker`` heartbeats every ``HEARTBEAT_S`` (fields settable while it runs), records the
RequestEvents and Aborts it receives, and, for the decode role, answers each event with the
TokenChunks ``reply(event)`` returns (None: stays silent), ``chunk_delay_s`` apart, on the
event's reply subject. An Abort stops a reply in progress, like a real decode worker.

``Stacks`` starts gateways (in-process, port 0) with their fake workers and an HTTP session
each, and stops them all on exit; ``write_model_dir`` writes just what a gateway reads from a
model folder (tokenizer, stamp, config.json) in well under a second.

Threading model: asyncio on the test's loop; one heartbeat task per worker, one task per reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import msgspec
from nats.aio.subscription import Subscription

from kvpush.connector.bus import Bus
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    Abort,
    FinishReason,
    RequestEvent,
    TokenChunk,
    Usage,
    WorkerHeartbeat,
    WorkerRole,
)
from kvpush.services import model_tokenizer, models
from kvpush.services.gateway import Gateway, GatewayConfig

HEARTBEAT_S = 0.1
Reply = Callable[[RequestEvent], list[TokenChunk]]


def counting_reply(event: RequestEvent) -> list[TokenChunk]:
    """``max_tokens`` chunks " w0", " w1", ... (token ids 10, 11, ...), finish ``length``."""
    n = event.sampling.max_tokens
    chunks = [
        TokenChunk(event.request_id, event.transfer_id, seq=i, token_ids=[10 + i], text=f" w{i}")
        for i in range(n)
    ]
    usage = Usage(prompt_tokens=len(event.prompt_token_ids), completion_tokens=n)
    chunks[-1] = msgspec.structs.replace(chunks[-1], finish_reason=FinishReason.LENGTH, usage=usage)
    return chunks


def chunk(event: RequestEvent, seq: int, text: str = "", **fields: object) -> TokenChunk:
    ids = [20 + seq] if text else []
    return TokenChunk(event.request_id, event.transfer_id, seq, ids, text, **fields)  # type: ignore[arg-type]


class FakeWorker:
    def __init__(
        self, bus: Bus, role: WorkerRole, worker_id: str, reply: Reply | None = counting_reply
    ) -> None:
        self.bus, self.role, self.worker_id = bus, role, worker_id
        self.reply = reply if role is WorkerRole.DECODE else None
        self.chunk_delay_s = 0.0
        self.in_flight = 0
        self.free_blocks = 100
        self.draining = False
        self.epoch = 1
        self.beating = True
        self.events: list[RequestEvent] = []
        self.aborts: list[Abort] = []
        self._subs: list[Subscription] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._beat_task: asyncio.Task[None] | None = None

    async def start(self) -> FakeWorker:
        if self.role is WorkerRole.PREFILL:
            requests = subjects.requests_for_prefill(self.worker_id)
        else:
            requests = subjects.requests_for_decode(self.worker_id)
        self._subs.append(await self.bus.subscribe(requests, self._on_request))
        self._subs.append(await self.bus.subscribe(subjects.abort(self.worker_id), self._on_abort))
        await self.bus.flush()
        await self._beat()
        self._beat_task = asyncio.create_task(self._beat_forever())
        return self

    async def stop(self) -> None:
        tasks = [t for t in (self._beat_task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _beat(self) -> None:
        await self.bus.publish(
            subjects.heartbeat(self.role, self.worker_id),
            WorkerHeartbeat(
                worker_id=self.worker_id,
                role=self.role,
                epoch=self.epoch,
                model="kvpush-tiny",
                side_channel="tcp://127.0.0.1:5555",
                in_flight=self.in_flight,
                queue_depth=0,
                free_blocks=self.free_blocks,
                total_blocks=100,
                sent_at_ms=int(time.time() * 1000),
                draining=self.draining,
            ),
            span=False,
        )

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if self.beating:
                await self._beat()

    async def _on_request(self, subject: str, message: BusMessage) -> None:
        assert isinstance(message, RequestEvent)
        self.events.append(message)
        if self.reply is not None:
            chunks = self.reply(message)
            task = asyncio.create_task(self._send(message.reply_subject, chunks))
            self._tasks[message.transfer_id] = task

    async def _send(self, subject: str, chunks: list[TokenChunk]) -> None:
        for item in chunks:
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            await self.bus.publish(subject, item, span=False)

    async def _on_abort(self, subject: str, message: BusMessage) -> None:
        if isinstance(message, Abort):
            self.aborts.append(message)
            task = self._tasks.pop(message.transfer_id, None)
            if task is not None:
                task.cancel()


def write_model_dir(out: Path) -> Path:
    """The tiny model's tokenizer, stamp, config.json and generation_config.json (no weights:
    gateways, vLLM's serving layer included, read no weights)."""
    tokenizer = model_tokenizer.train_tokenizer(
        models.TINY.vocab_size, models.TINY.max_context, models.TINY.seed
    )
    model_tokenizer.write_tokenizer(tokenizer, out)
    stamp = {"format": models.STAMP_FORMAT, "recipe": dataclasses.asdict(models.TINY)}
    (out / models.STAMP_FILE).write_text(json.dumps(stamp))
    for config in models.hf_configs(models.TINY, tokenizer):
        config.save_pretrained(str(out))
    return out


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def sse_events(text: str) -> list[Any]:
    """The JSON events of an SSE body, which must end with ``data: [DONE]``."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


class Stack:
    """A gateway, its fake workers and an HTTP session."""

    def __init__(self, gateway: Gateway, workers: list[FakeWorker]) -> None:
        self.gateway, self.workers = gateway, workers
        self.http = aiohttp.ClientSession()
        self.prefill = next((w for w in workers if w.role is WorkerRole.PREFILL), None)
        self.decode = next((w for w in workers if w.role is WorkerRole.DECODE), None)

    async def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.gateway.url + path, json=body, **kw) as resp:
            text = await resp.text()
            is_json = "json" in resp.headers.get("Content-Type", "")
            return resp.status, json.loads(text) if is_json else text

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return await self.call("POST", path, body, **kw)


class Stacks:
    """``async with Stacks(...) as make: s = await make(prefill=..., **config_overrides)``."""

    _ids = itertools.count()

    def __init__(self, bus: Bus, model_dir: Path, nats_url: str) -> None:
        self.bus, self.model_dir, self.nats_url = bus, model_dir, nats_url
        self.made: list[Stack] = []

    async def __aenter__(self) -> Callable[..., Any]:
        return self.make

    async def make(
        self,
        prefill: tuple[str, ...] = ("p",),
        decode: tuple[str, ...] = ("d",),
        reply: Reply | None = counting_reply,
        share: Stack | None = None,
        **overrides: Any,
    ) -> Stack:
        """A gateway with new fake workers, or with the workers of ``share`` (not new ones)."""
        n = next(self._ids)
        if share is not None:
            workers = share.workers
        else:
            workers = [FakeWorker(self.bus, WorkerRole.PREFILL, f"{p}{n}") for p in prefill]
            workers += [FakeWorker(self.bus, WorkerRole.DECODE, f"{d}{n}", reply) for d in decode]
            for worker in workers:
                await worker.start()
        fields = {"request_timeout_s": 10.0, "worker_lease_s": 0.5, "max_body_bytes": 4096}
        config = GatewayConfig(
            model=str(self.model_dir), port=0, nats_url=self.nats_url, **{**fields, **overrides}
        )
        stack = Stack(await Gateway.start(config), workers)
        self.made.append(stack)
        roles = [w.role for w in workers]
        want = {
            "prefill": roles.count(WorkerRole.PREFILL),
            "decode": roles.count(WorkerRole.DECODE),
        }
        await wait_until(lambda: stack.gateway.registry.counts() == want)
        return stack

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for stack in self.made:
            await stack.http.close()
            await stack.gateway.stop(grace_s=0)
        for worker in {id(w): w for stack in self.made for w in stack.workers}.values():
            await worker.stop()
