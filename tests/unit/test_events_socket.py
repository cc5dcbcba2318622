"""The file of a worker's KV events socket: its name, and the files killed processes of the same
worker left, removed at the worker's next start (``services/workers/events_socket.py``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.services.workers import events_socket
from kvpush.services.workers.events_socket import (
    IPC_PATH_MAX,
    events_endpoint,
    ipc_endpoint,
    remove_stale_sockets,
)


def test_an_ipc_endpoint_past_the_socket_path_limit_falls_back_to_tmp() -> None:
    assert ipc_endpoint("kvev-1", "/var/tmp") == "ipc:///var/tmp/kvev-1"
    deep = "/" + "d" * (IPC_PATH_MAX - len("/kvev-1"))  # one byte too long
    assert ipc_endpoint("kvev-1", deep[:-1]) == f"ipc://{deep[:-1]}/kvev-1"
    assert ipc_endpoint("kvev-1", deep) == "ipc:///tmp/kvev-1"


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory short enough that a socket path in it stays in it (pytest's tmp_path can
    pass the limit, and ``ipc_endpoint`` then falls back to /tmp)."""
    directory = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def bound(endpoint: str) -> Path:
    """A socket file at ``endpoint`` as a bound socket leaves it after its process died."""
    path = endpoint.removeprefix("ipc://")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
    return Path(path)


def test_a_restarted_worker_removes_the_sockets_its_killed_processes_left(short_dir: str) -> None:
    own = events_endpoint("decode-0", os.getpid(), short_dir)
    assert own.startswith(f"ipc://{short_dir}/kvpush-kvev-{os.getpid()}-")
    dead = dead_pid()
    bound(own)  # this process's engine's: stays
    killed = bound(events_endpoint("decode-0", dead, short_dir))
    older = bound(events_endpoint("decode-0", dead_pid(), short_dir))
    alive = bound(events_endpoint("decode-0", os.getppid(), short_dir))  # a live process's
    other = bound(events_endpoint("decode-1", dead, short_dir))  # another worker's
    not_a_socket = Path(events_endpoint("decode-0", dead_pid(), short_dir).removeprefix("ipc://"))
    not_a_socket.write_text("")
    tag = killed.name.rsplit("-", 1)[1]
    # names anyone may make in a shared temp directory: none of them is this worker's to remove
    target = bound(ipc_endpoint("kvpush-target", short_dir))
    link = Path(short_dir, f"kvpush-kvev-{dead_pid()}-{tag}")
    link.symlink_to(target)  # a link to a socket: lstat sees the link
    folder = Path(short_dir, f"kvpush-kvev-{dead_pid()}-{tag}")
    folder.mkdir()
    dashes = bound(ipc_endpoint(f"kvpush-kvev-1-{dead}-{tag}", short_dir))
    odd = [bound(ipc_endpoint(f"kvpush-kvev-{pid}-{tag}", short_dir)) for pid in ODD_PIDS]
    assert sorted(remove_stale_sockets(own)) == sorted([str(killed), str(older)])
    left = {p.name for p in Path(short_dir).iterdir()}
    kept = {own.rsplit("/", 1)[1], alive.name, other.name, not_a_socket.name, target.name}
    assert left == kept | {link.name, folder.name, dashes.name} | {p.name for p in odd}
    assert remove_stale_sockets(own) == []  # nothing more to take
    assert remove_stale_sockets("tcp://127.0.0.1:5557") == []  # no file socket: nothing


ODD_PIDS = ("\u00b2", "\u0663", "99999999999999999999", "0", "007", "")  # ², Arabic-Indic 3


def test_a_process_of_another_user_counts_alive(
    short_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = events_endpoint("prefill-0", os.getpid(), short_dir)
    theirs = bound(events_endpoint("prefill-0", dead_pid(), short_dir))
    other_user = int(theirs.name.split("-")[2])

    def kill(pid: int, signal: int) -> None:  # as the kernel answers for another user's pid
        raise PermissionError(1, "Operation not permitted") if pid == other_user else OSError()

    monkeypatch.setattr(events_socket.os, "kill", kill)
    assert remove_stale_sockets(own) == [] and theirs.exists()
