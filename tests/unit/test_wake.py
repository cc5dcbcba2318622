"""The connector's wake-up paths without vLLM: the datagram line from worker halves to the
scheduler half, and the deadline timer of a worker half."""

from __future__ import annotations

import threading
import time
import uuid

from kvpush.connector.vllm.runtime import WakeTimer
from kvpush.connector.vllm.wake import WakeListener, WakeSender


def test_a_notify_from_another_sender_sets_the_listeners_event_and_close_ends_it() -> None:
    engine_id = uuid.uuid4().hex
    listener = WakeListener(engine_id)
    sender = WakeSender(engine_id)
    try:
        assert not listener.event.is_set()
        sender.notify()
        assert listener.event.wait(5)
    finally:
        sender.close()
        listener.close()
    assert not listener._thread.is_alive()


def test_a_notify_nobody_listens_to_is_lost_quietly() -> None:
    sender = WakeSender(uuid.uuid4().hex)
    sender.notify()  # no listener bound: no error
    sender.close()


def test_another_senders_stop_datagram_does_not_stop_the_listener() -> None:
    engine_id = uuid.uuid4().hex
    listener = WakeListener(engine_id)
    try:
        listener._sock.sendto(b"s", listener.address)  # what close() sends, from outside
        assert listener.event.wait(5) and listener._thread.is_alive()
    finally:
        listener.close()


def test_the_timer_wakes_once_per_due_time_earliest_first() -> None:
    woken: list[float] = []
    done = threading.Event()

    def wake() -> None:
        woken.append(time.monotonic())
        if len(woken) == 2:
            done.set()

    timer = WakeTimer(wake)
    start = time.monotonic()
    timer.at(start + 0.2)
    timer.at(start + 0.05)  # earlier than the one already waited for
    try:
        assert done.wait(5)
    finally:
        timer.close()
    assert woken[0] >= start + 0.05 and woken[1] >= start + 0.2


def test_the_timer_keeps_at_most_its_limit_of_deadlines() -> None:
    timer = WakeTimer(lambda: None, limit=2)
    for _ in range(5):
        timer.at(time.monotonic() + 60)
    assert len(timer._times) == 2
    timer.close()
