"""The bus over a real nats-server: routing, trace context, bad input, bounds, reconnect, auth."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush.connector.bus import Bus, BusConfig, BusConnectError
from kvpush.schemas import Abort, RequestEvent, SamplingSpec, encode, subjects
from kvpush.schemas.codec import BusMessage
from kvpush.services.natsd import EmbeddedNats

TIMEOUT = 10.0  # generous: CI boxes run engines in other tests of the session


def _request(prefill: str, decode: str, transfer_id: str = "tx-00000001") -> RequestEvent:
    return RequestEvent(
        transfer_id=transfer_id,
        request_id="r-1",
        prefill_id=prefill,
        decode_id=decode,
        model="tiny",
        prompt_token_ids=[1, 2, 3],
        reply_subject=subjects.tokens("gw0"),
        deadline_ms=1,
        sampling=SamplingSpec(),
    )


async def wait_until(predicate: Callable[[], bool], timeout_s: float = TIMEOUT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Inbox:
    """Collects (subject, message) pairs delivered to one subscription."""

    def __init__(self) -> None:
        self.items: list[tuple[str, BusMessage]] = []
        self._changed = asyncio.Event()

    async def __call__(self, subject: str, message: BusMessage) -> None:
        self.items.append((subject, message))
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        async def _until() -> None:
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(_until(), TIMEOUT)

    def transfer_ids(self) -> list[str]:
        return [m.transfer_id for _, m in self.items]  # type: ignore[union-attr]


@pytest.fixture
async def second_bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connection = await Bus.connect(BusConfig(url=nats_server.url, name="test-2"))
    yield connection
    await connection.close()


async def test_one_publish_reaches_exactly_its_prefill_and_decode(
    bus: Bus, second_bus: Bus
) -> None:
    inboxes = {name: Inbox() for name in ("p1", "p2", "d1", "d2")}
    await second_bus.subscribe(subjects.requests_for_prefill("p1"), inboxes["p1"])
    await second_bus.subscribe(subjects.requests_for_prefill("p2"), inboxes["p2"])
    await second_bus.subscribe(subjects.requests_for_decode("d1"), inboxes["d1"])
    await second_bus.subscribe(subjects.requests_for_decode("d2"), inboxes["d2"])
    await second_bus.flush()

    await bus.publish(subjects.request("p1", "d1"), _request("p1", "d1", "tx-target01"))
    # Sentinels: per-connection ordering means p2/d2 would see the target before these.
    await bus.publish(subjects.request("p2", "d2"), _request("p2", "d2", "tx-sentinel"))
    for name in inboxes:
        await inboxes[name].wait_for(1)
    await asyncio.sleep(0.05)

    assert inboxes["p1"].transfer_ids() == ["tx-target01"]
    assert inboxes["d1"].transfer_ids() == ["tx-target01"]
    assert inboxes["p2"].transfer_ids() == ["tx-sentinel"]
    assert inboxes["d2"].transfer_ids() == ["tx-sentinel"]
    assert inboxes["p1"].items[0][0] == "kvpush.v1.req.p1.d1"


async def test_flush_returns_only_after_the_server_processed_earlier_subscriptions() -> None:
    """nats-py's own flush writes its PING ahead of a SUB still in the client's buffer, so
    another client's publish right after it could miss the subscription (the bus tests' old
    flake). The server's protocol trace shows the order it processed our commands in."""
    server = EmbeddedNats(extra_args=("-V",))  # -V: trace every protocol line received
    server.start()
    try:
        traced = await Bus.connect(BusConfig(url=server.url, name="traced"))
        await traced.subscribe(subjects.abort("w9"), Inbox())
        await traced.flush()
        ops: list[str] = []

        def received_ops() -> bool:
            lines = server.log_text().splitlines()
            ops[:] = [line.rsplit("<<- [", 1)[1] for line in lines if "<<- [" in line]
            return any(op.startswith("SUB kvpush.v1.abort.w9") for op in ops)

        await wait_until(received_ops)
        await traced.close()
    finally:
        server.stop()
    sub = next(i for i, op in enumerate(ops) if op.startswith("SUB kvpush.v1.abort.w9"))
    pings = [i for i, op in enumerate(ops) if op.startswith("PING")]
    # connect's own PING, then the flush's: the flush's PING must follow the SUB
    assert len(pings) == 2 and pings[0] < sub < pings[1], ops


async def test_trace_context_in_headers_parents_the_receiving_span(
    bus: Bus, second_bus: Bus, spans: InMemorySpanExporter
) -> None:
    seen: list[trace.SpanContext] = []

    async def handler(subject: str, message: BusMessage) -> None:
        seen.append(trace.get_current_span().get_span_context())

    await second_bus.subscribe(subjects.abort("w1"), handler)
    await second_bus.flush()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("test.root") as root:
        await bus.publish(subjects.abort("w1"), Abort(transfer_id="tx-00000002", sender="gw0"))
    await bus.flush()
    await wait_until(lambda: bool(seen))
    assert len(seen) == 1

    finished = {s.name: s for s in spans.get_finished_spans()}
    publish, receive = finished["bus.publish"], finished["bus.receive"]
    root_ctx = root.get_span_context()
    assert publish.parent is not None and publish.parent.span_id == root_ctx.span_id
    assert receive.parent is not None and receive.parent.span_id == publish.context.span_id
    assert receive.context.trace_id == root_ctx.trace_id
    assert seen[0].span_id == receive.context.span_id  # the handler ran inside bus.receive
    assert receive.attributes["messaging.destination.name"] == "kvpush.v1.abort.w1"


async def test_malformed_messages_are_counted_and_the_subscriber_keeps_serving(
    bus: Bus, second_bus: Bus
) -> None:
    inbox = Inbox()
    await second_bus.subscribe(subjects.requests_for_prefill("p7"), inbox)
    await second_bus.flush()
    raw = bus.client
    await raw.publish("kvpush.v1.req.p7.d7", b"{not json")
    await raw.publish("kvpush.v1.req.p7.d7", b'{"type":"kvpush.v9.RequestEvent"}')
    await raw.publish(
        "kvpush.v1.req.p7.d7", b'{"type":"kvpush.v1.RequestEvent","prompt_token_ids":[-1]}'
    )
    await raw.publish("kvpush.v1.req.p7.d7", encode(_request("p7", "d8")))  # D contradicts subject
    await bus.publish(subjects.request("p7", "d7"), _request("p7", "d7", "tx-good0001"))
    await inbox.wait_for(1)
    await asyncio.sleep(0.05)
    assert inbox.transfer_ids() == ["tx-good0001"]
    assert second_bus.stats.malformed == {"malformed": 2, "version": 1, "mismatch": 1}


async def test_a_failing_handler_is_counted_and_does_not_stop_delivery(
    bus: Bus, second_bus: Bus
) -> None:
    delivered: list[str] = []

    async def flaky(subject: str, message: BusMessage) -> None:
        delivered.append(message.transfer_id)  # type: ignore[union-attr]
        if len(delivered) == 1:
            raise RuntimeError("boom")

    await second_bus.subscribe(subjects.abort("w2"), flaky)
    await second_bus.flush()
    for i in range(3):
        await bus.publish(subjects.abort("w2"), Abort(transfer_id=f"tx-flaky00{i}", sender="gw0"))
    await bus.flush()  # on the wire now, not whenever the client's flusher task runs
    await wait_until(lambda: len(delivered) == 3)
    assert delivered == ["tx-flaky000", "tx-flaky001", "tx-flaky002"]
    assert second_bus.stats.handler_errors == 1


async def test_pending_bound_drops_past_the_limit_and_reports_it(nats_server: EmbeddedNats) -> None:
    slow = await Bus.connect(BusConfig(url=nats_server.url, name="slow", pending_msgs_limit=4))
    fast = await Bus.connect(BusConfig(url=nats_server.url, name="fast"))
    try:
        release = asyncio.Event()
        got: list[str] = []

        async def blocked(subject: str, message: BusMessage) -> None:
            await release.wait()
            got.append(message.transfer_id)  # type: ignore[union-attr]

        await slow.subscribe(subjects.abort("w3"), blocked)
        await slow.flush()
        for i in range(50):
            await fast.publish(
                subjects.abort("w3"), Abort(transfer_id=f"tx-burst{i:03d}", sender="g"), span=False
            )
        await fast.flush()
        await wait_until(lambda: slow.stats.dropped > 0)
        release.set()
        await asyncio.sleep(0.2)
        assert slow.stats.dropped > 0
        assert 0 < len(got) < 50  # bounded: some delivered, the overflow dropped
    finally:
        await slow.close()
        await fast.close()


async def test_bus_reconnects_after_the_server_restarts() -> None:
    server = EmbeddedNats()
    server.start()
    try:
        sub_bus = await Bus.connect(BusConfig(url=server.url, name="r1", reconnect_wait_s=0.1))
        pub_bus = await Bus.connect(BusConfig(url=server.url, name="r2", reconnect_wait_s=0.1))
        inbox = Inbox()
        await sub_bus.subscribe(subjects.abort("w4"), inbox)
        await sub_bus.flush()
        server.restart()
        await wait_until(
            lambda: sub_bus.is_connected and pub_bus.is_connected and sub_bus.stats.reconnects > 0
        )
        await sub_bus.flush()
        await pub_bus.publish(
            subjects.abort("w4"), Abort(transfer_id="tx-after-restart", sender="g")
        )
        await inbox.wait_for(1)
        assert inbox.transfer_ids() == ["tx-after-restart"]
        await sub_bus.close()
        await pub_bus.close()
    finally:
        server.stop()


async def test_server_with_auth_refuses_anonymous_clients_and_accepts_credentials() -> None:
    server = EmbeddedNats(extra_args=("--user", "kv", "--pass", "s3cret"))
    server.start()
    try:
        anonymous = BusConfig(url=server.url, initial_connect_timeout_s=3.0)
        with pytest.raises(BusConnectError, match="Authorization Violation"):
            await Bus.connect(anonymous)
        ok = await Bus.connect(BusConfig(url=server.url, user="kv", password="s3cret"))
        assert ok.is_connected
        await ok.close()
    finally:
        server.stop()
