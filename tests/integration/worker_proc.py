"""Worker processes for tests: ``kvpush prefill|decode`` children and a bus-side ``Observer``.

``WorkerProc`` runs one worker exactly as deployed (``python -m kvpush.services.cli <role>``)
with its log in a file; ``Observer`` is what a gateway is to the workers: it records every
heartbeat, publishes RequestEvents and collects the TokenChunks of each request from its own
token subject. pytest itself never imports vllm.

Threading model: ``Observer`` lives on the test session's asyncio loop; children are plain
subprocesses (their own sessions, so a test's signal reaches exactly one of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    RequestEvent,
    SamplingSpec,
    TokenChunk,
    TransferMode,
    WorkerHeartbeat,
    WorkerRole,
)

MODEL = "kvpush-tiny"


class WorkerProc:
    """One worker child process."""

    def __init__(
        self,
        role: str,
        worker_id: str,
        nats_url: str,
        model_dir: str | Path,
        cores: list[int],
        log_dir: str | Path,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = {**os.environ, **(env or {})}
        self.role, self.worker_id = role, worker_id
        self.log_path = Path(log_dir) / f"{worker_id}.log"
        self.argv = [
            sys.executable, "-m", "kvpush.services.cli", role, "--id", worker_id,
            "--nats", nats_url, "--model", str(model_dir),
            "--cpus", ",".join(map(str, cores)), *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProc:
        with open(self.log_path, "ab") as log:  # a restarted worker appends
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        return self

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the worker drains), SIGKILL after ``timeout_s``; the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- {self.log_path} ---\n" + "\n".join(text)


class Observer:
    """Heartbeats of every worker, and request/response over the bus like a gateway."""

    def __init__(self, bus: Bus, gateway_id: str) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.reply_subject = subjects.tokens(gateway_id)
        self.beats: dict[str, list[WorkerHeartbeat]] = defaultdict(list)
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self._changed = asyncio.Event()

    @classmethod
    async def connect(cls, url: str, gateway_id: str = "gw-test") -> Observer:
        observer = cls(await Bus.connect(BusConfig(url=url, name=gateway_id)), gateway_id)
        await observer.bus.subscribe(subjects.heartbeats(), observer._on_message)
        await observer.bus.subscribe(observer.reply_subject, observer._on_message)
        await observer.bus.flush()
        return observer

    async def close(self) -> None:
        await self.bus.close()

    async def _on_message(self, subject: str, message: BusMessage) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.beats[message.worker_id].append(message)
        elif isinstance(message, TokenChunk):
            self.chunks[message.request_id].append(message)
        self._changed.set()

    async def wait_for(
        self, predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{what} not reached within {timeout_s} s")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.2))

    async def wait_ready(self, procs: list[WorkerProc], timeout_s: float = 240.0) -> None:
        """Until every worker sent a heartbeat (fails with the log of a worker that exited)."""

        def ready() -> bool:
            for proc in procs:
                if proc.returncode is not None:
                    raise AssertionError(
                        f"{proc.worker_id} exited ({proc.returncode})" + proc.tail()
                    )
            return all(self.beats.get(p.worker_id) for p in procs)

        await self.wait_for(ready, timeout_s, "workers ready")

    def last_beat(self, worker_id: str) -> WorkerHeartbeat:
        return self.beats[worker_id][-1]

    async def fresh_beat(
        self, worker_id: str, predicate: Callable[[WorkerHeartbeat], bool], timeout_s: float = 15.0
    ) -> WorkerHeartbeat:
        """The first heartbeat of ``worker_id`` from now on that satisfies ``predicate``."""
        seen = len(self.beats[worker_id])

        def found() -> bool:
            return any(predicate(b) for b in self.beats[worker_id][seen:])

        await self.wait_for(found, timeout_s, f"a heartbeat of {worker_id}")
        return next(b for b in self.beats[worker_id][seen:] if predicate(b))

    def event(
        self,
        prefill_id: str,
        decode_id: str,
        prompt: list[int],
        mode: str = "push",
        max_tokens: int = 8,
        *,
        deadline_s: float = 60.0,
        stream: bool = True,
        model: str = MODEL,
        first_token_by: str = "prefill",
        **sampling: Any,
    ) -> RequestEvent:
        """A RequestEvent as the gateway makes it (greedy unless ``sampling``, SamplingSpec
        fields, says otherwise; P samples the first token in push and pull, as the gateway's
        default has it)."""
        tid = secrets.token_urlsafe(12)
        return RequestEvent(
            transfer_id=tid,
            request_id=f"r-{tid}",
            prefill_id=prefill_id,
            decode_id=decode_id,
            model=model,
            prompt_token_ids=prompt,
            reply_subject=self.reply_subject,
            deadline_ms=int((time.time() + deadline_s) * 1000),
            sampling=SamplingSpec(**{"max_tokens": max_tokens, "temperature": 0.0, **sampling}),
            mode=TransferMode(mode),
            stream=stream,
            first_token_by=WorkerRole(first_token_by if mode != "local" else "decode"),
        )

    async def publish(self, event: RequestEvent) -> None:
        await self.bus.publish(subjects.request(event.prefill_id, event.decode_id), event)

    def finished(self, request_id: str) -> bool:
        chunks = self.chunks.get(request_id, [])
        return any(c.finish_reason is not None or c.error is not None for c in chunks)

    async def collect(self, event: RequestEvent, timeout_s: float = 60.0) -> list[TokenChunk]:
        """Every chunk of ``event`` (already published) up to the final one, in seq order."""
        rid = event.request_id
        await self.wait_for(lambda: self.finished(rid), timeout_s, f"the end of {rid}")
        return sorted(self.chunks[rid], key=lambda c: c.seq)

    async def generate(self, event: RequestEvent, timeout_s: float = 60.0) -> list[TokenChunk]:
        await self.publish(event)
        return await self.collect(event, timeout_s)


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks: list[TokenChunk]) -> str:
    return "".join(c.text for c in chunks)


def kill_all(procs: list[WorkerProc]) -> None:
    """Last resort at the end of a fixture: nothing of the test outlives it."""
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait()
