"""The file of a worker's KV events socket (``cache_events``): its name, and the ones killed
processes left.

vLLM's engine binds its KV events PUB socket at ``events_endpoint``: an ipc:// file socket,
``kvpush-kvev-<pid>-<hash of the worker id>`` in the temp directory (a file socket: under the usual
umask 022 only its owner may connect; an abstract one, which leaves no file, would let any process
in the host's network namespace read the prompts' token ids the events carry).
``CacheEventReader.stop`` removes the file on a clean stop; a worker killed with ``kill -9``
cannot, so the next start of a worker of the same ``--worker-id`` (``kvpush up`` and the
Kubernetes manifests restart workers so; a default id holds the pid, so its leftovers stay) removes
what its dead predecessors left (``remove_stale_sockets``, called by
``cache_publisher.CachePublisher.open``).

Threading model: none (functions over the file system, called on the worker's loop at start).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import stat
from typing import Final

IPC_PATH_MAX: Final = 107  # bytes of a unix socket path (sun_path less its NUL)
SOCKET_PREFIX: Final = "kvpush-kvev-"  # events_endpoint's names: <prefix><pid>-<worker's hash>
_PID: Final = re.compile(r"[1-9][0-9]{0,9}")  # a pid as events_endpoint writes it (ASCII only)


def ipc_endpoint(name: str, directory: str) -> str:
    """``ipc://directory/name``, or in /tmp when that path would pass the socket path limit
    (a long TMPDIR): ZMQ refuses such a path (``File name too long``)."""
    path = os.path.join(directory, name)
    if len(path.encode()) > IPC_PATH_MAX:
        path = os.path.join("/tmp", name)
    return f"ipc://{path}"


def events_endpoint(worker_id: str, pid: int, directory: str) -> str:
    """The worker's events socket: ``kvpush-kvev-<pid>-<hash of worker_id>`` in ``directory``
    (or /tmp: ``ipc_endpoint``)."""
    tag = hashlib.blake2b(worker_id.encode(), digest_size=6).hexdigest()
    return ipc_endpoint(f"{SOCKET_PREFIX}{pid}-{tag}", directory)


def remove_stale_sockets(endpoint: str) -> list[str]:
    """Remove the socket files that earlier processes of the same worker left beside
    ``endpoint`` (``events_endpoint``'s, another pid and no process of it alive): a worker
    killed with ``kill -9`` leaves its engine's (a clean stop removes it), so the worker's next
    start (``kvpush up`` restarts it under its id) takes it away. Files of other workers,
    of live processes, of other users, and anything that is no socket stay. Returns the paths
    removed."""
    path = endpoint.removeprefix("ipc://")
    directory, name = os.path.split(path)
    parts = name.removeprefix(SOCKET_PREFIX).split("-")
    if not endpoint.startswith("ipc://") or not name.startswith(SOCKET_PREFIX) or len(parts) != 2:
        return []
    own_pid, tag = parts
    removed: list[str] = []
    for stale in glob.glob(os.path.join(glob.escape(directory), f"{SOCKET_PREFIX}*-{tag}")):
        pid = os.path.basename(stale).removeprefix(SOCKET_PREFIX).removesuffix(f"-{tag}")
        if not _PID.fullmatch(pid) or pid == own_pid or _alive(int(pid)):
            continue  # no name of ours (anyone may make files here), or a live process's
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            info = os.lstat(stale)
            if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.getuid():
                os.unlink(stale)
                removed.append(stale)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` may be a live process (when in doubt: yes, and the file stays)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's, or no pid at all
        return True
    return True
