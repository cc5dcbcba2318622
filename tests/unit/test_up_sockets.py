"""The listening sockets ``kvpush up`` binds for its children before any starts
(``services/up_sockets.py``): a port in use fails at once with one line, port 0 gets the
kernel's pick, and the plan hands each socket to its child (``--listen-fd``, ``--metrics-fd``,
``pass_fds``) with the URLs built from the real ports."""

from __future__ import annotations

import argparse
import socket

import pytest

from kvpush.schemas.messages import WorkerRole
from kvpush.services import settings
from kvpush.services.gateway import config as gateway_config
from kvpush.services.up_config import SETTINGS as UP_SETTINGS
from kvpush.services.up_config import UpConfig
from kvpush.services.up_sockets import (
    ListenError,
    close_all,
    http_url,
    listen,
    port_of,
    reachable_host,
    worker_metrics_host,
)
from kvpush.services.workers import config as worker_config


def test_a_port_in_use_fails_at_once_with_one_clear_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = port_of(taken)
        with pytest.raises(ListenError) as failed:
            listen("127.0.0.1", port)
    assert str(failed.value) == (
        f"port {port} on 127.0.0.1 is in use: stop what holds it or pick another --port"
    )


def test_port_0_gets_a_real_port_on_a_listening_inheritable_socket() -> None:
    sock = listen("127.0.0.1", 0)
    try:
        port = port_of(sock)
        assert 0 < port <= 65535 and sock.get_inheritable()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        # it listens now: the kernel queues a connection before any child accepts it
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        close_all([sock, None, sock])  # twice and None: nothing
    assert sock.fileno() == -1


def test_urls_name_an_address_a_local_client_reaches() -> None:
    assert [reachable_host(h) for h in ("0.0.0.0", "", "::", "10.0.0.5")] == [
        "127.0.0.1",
        "127.0.0.1",
        "::1",
        "10.0.0.5",
    ]
    assert http_url("::1", 8000) == "http://[::1]:8000"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert worker_metrics_host({}) == "127.0.0.1"  # the workers' --side-channel-host default
    assert worker_metrics_host({"KVPUSH_SIDE_CHANNEL_HOST": "10.0.0.5"}) == "10.0.0.5"


def test_kvpush_up_hands_each_child_the_socket_it_bound(tmp_path, monkeypatch) -> None:
    """The gateway serves on up's socket (--listen-fd), each worker its metrics on one of its
    own (--metrics-fd, stats on); each descriptor is passed to that child alone, and the URLs
    up prints carry the ports the kernel picked."""
    from kvpush.services.up import Stack

    monkeypatch.delenv("KVPUSH_SIDE_CHANNEL_HOST", raising=False)
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, UP_SETTINGS)
    config = UpConfig.from_args(parser.parse_args(["--port", "0", "--log-dir", str(tmp_path)]), {})
    stack = Stack(config)
    stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    stack.listener = listen(config.host, config.port)  # what setup binds first
    stack.port = port_of(stack.listener)
    try:
        stack._plan()
        assert stack.gateway is not None
        gateway_argv = stack.gateway.argv
        gateway_fd = stack.listener.fileno()
        assert stack.gateway.pass_fds == (gateway_fd,)
        gateway_args = argparse.ArgumentParser()
        gateway_config.add_arguments(gateway_args)
        parsed = gateway_config.GatewayConfig.from_args(
            gateway_args.parse_args(gateway_argv[gateway_argv.index("gateway") + 1 :]), {}
        )
        assert (parsed.listen_fd, parsed.port) == (gateway_fd, stack.port)
        worker_args = argparse.ArgumentParser()
        worker_config.add_arguments(worker_args)
        assert len(stack.workers) == len(stack.metrics_sockets) == 2
        for child, held in zip(stack.workers, stack.metrics_sockets, strict=True):
            assert child.pass_fds == (held.fileno(),)
            assert child.metrics_url == f"http://127.0.0.1:{port_of(held)}/metrics"
            at = child.argv.index("kvpush.services.cli") + 1
            worker = worker_config.config_from_args(
                WorkerRole(child.argv[at]), worker_args.parse_args(child.argv[at + 1 :]), {}
            )
            assert worker.metrics_fd == held.fileno() and worker.metrics_port is None
            assert worker.engine_config().log_stats  # the engine records what is served
        stack.model_name = "kvpush-tiny"
        assert f"kvpush is up: http://127.0.0.1:{stack.port}/v1 " in stack.banner()
    finally:
        close_all([stack.listener, *stack.metrics_sockets])


def test_a_worker_refuses_a_negative_metrics_fd(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--metrics-fd", "-1", "--model", str(tmp_path)])
    with pytest.raises(settings.ConfigError, match="--metrics-fd must be >= 0"):
        worker_config.config_from_args(WorkerRole.DECODE, args, {})
