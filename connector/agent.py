"""A thin wrapper over one NIXL agent: config, backend, registration, peers, posts, notifications.

Owns the ``nixl._api.nixl_agent`` and every NIXL handle made from it, and turns NIXL's
exceptions (``nixlRemoteDisconnectError`` & co., raised by post/check/notify) into
``AgentError`` with the NIXL status name. It knows nothing about transfers or block ids.

Choices (measured on the project's 2-core CPU boxes, see docs/benchmarks/transport.md):
- no NIXL progress thread (``enable_prog_thread=False``): the owner's poller drives progress
  through ``status()`` and ``notifications()``; NIXL's thread busy-spins a core.
- UCX with ``ucx_error_handling_mode=none`` by default: on one host data moves by CMA
  (one-sided: the target need not progress) and notifications by shared memory. ``peer`` mode
  puts wire-up and notifications on TCP, a transfer carrying its own notification took ~8 ms,
  and a target that did not drive progress made the initiator's transfer fail with
  NIXL_ERR_REMOTE_DISCONNECT. A dead peer is still detected in ``none`` mode on one host (CMA
  fails, posts raise NIXL_ERR_REMOTE_DISCONNECT); across hosts choose ``peer`` and keep the
  target polling. Either way transfer deadlines release handles, so a silent peer cannot pin
  blocks forever.
- backends are created explicitly so their parameters can be passed (``nixl_agent_config``
  creates them with none).

Threading model: not thread-safe. Exactly one thread at a time may call into an ``NixlAgent``;
``KvTransport`` serialises every call under its lock (``TransferEngine`` runs inside it).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvpush.connector.layout import MemType, PoolLayout, registration_descs

log = logging.getLogger(__name__)

DEFAULT_UCX_PARAMS = {"ucx_error_handling_mode": "none", "num_workers": "1"}


class Backend(str, enum.Enum):
    UCX = "UCX"  # default: CPU and single-node GPU
    LIBFABRIC = "LIBFABRIC"  # EFA/GPU clusters; needs libcuda on the host


class XferStatus(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class AgentConfig(msgspec.Struct, frozen=True):
    """How to build the NIXL agent. ``backend_params`` override ``DEFAULT_UCX_PARAMS`` for UCX;
    ``ucx_env`` (``UCX_*`` variables) is applied with ``setdefault`` before the agent exists."""

    name: str
    backend: Backend = Backend.UCX
    backend_params: dict[str, str] = {}
    ucx_env: dict[str, str] = {}
    telemetry: bool = False


class AgentError(RuntimeError):
    """A NIXL call failed; ``status`` is NIXL's status name (e.g. NIXL_ERR_REMOTE_DISCONNECT)."""

    def __init__(self, what: str, exc: BaseException | str) -> None:
        if isinstance(exc, BaseException):
            exc = exc.args[0] if exc.args else type(exc).__name__
        self.status = str(exc)
        super().__init__(f"{what}: {self.status}")


@dataclass(eq=False, slots=True)
class XferHandle:
    """One posted NIXL request. ``release()`` must succeed before its memory may be reused."""

    raw: Any
    nbytes: int
    descriptors: int
    released: bool = False


class NixlAgent:
    """One NIXL agent with one backend and one registered KV pool (plus optional extra buffers)."""

    def __init__(self, config: AgentConfig) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        for key, value in config.ucx_env.items():
            os.environ.setdefault(key, value)
        from nixl._api import nixl_agent, nixl_agent_config

        self.config = config
        conf = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            capture_telemetry=config.telemetry,
        )
        self._nixl = nixl_agent(config.name, conf)
        params = dict(DEFAULT_UCX_PARAMS) if config.backend is Backend.UCX else {}
        params.update(config.backend_params)
        if config.backend.value not in self._nixl.get_plugin_list():
            raise AgentError(f"NIXL backend {config.backend.value}", "plugin not installed")
        try:
            self._nixl.create_backend(config.backend.value, params)
        except Exception as exc:
            raise AgentError(
                f"creating NIXL backend {config.backend.value} with {params} (LIBFABRIC needs "
                "libcuda and a fabric provider)",
                exc,
            ) from exc
        self._registered: list[Any] = []
        self._dlists: list[Any] = []
        self.live_handles = 0

    # ---- memory -----------------------------------------------------------------------------
    def register(self, layout: PoolLayout) -> None:
        """Register each KV tensor as one region (adjacent K/V views of one tensor merge)."""
        self.register_rows(registration_descs(layout), layout.mem_type)

    def register_rows(self, rows: np.ndarray, mem_type: MemType) -> None:
        try:
            self._registered.append(self._nixl.register_memory(rows, mem_type.value))
        except Exception as exc:
            raise AgentError("registering memory", exc) from exc

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered regions). NIXL's own
        serialisation, not a pickle; sent as an opaque byte string on the side channel."""
        return bytes(self._nixl.get_agent_metadata())

    # ---- peers ------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._nixl.add_remote_agent(metadata)
        except Exception as exc:
            raise AgentError("loading peer metadata", exc) from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:  # connect now so the first transfer does not pay the wire-up
            self._nixl.make_connection(name)
        except Exception as exc:
            log.warning("make_connection(%s) failed: %s", name, exc)
        return name

    def remove_peer(self, name: str) -> None:
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as exc:
            log.warning("removing peer agent %s: %s", name, exc)

    # ---- descriptor lists -------------------------------------------------------------------
    def prep(self, peer: str | None, rows: np.ndarray, mem_type: MemType) -> Any:
        """Prepare a per-block list (``peer=None``: local side); freed by ``close``/``unprep``."""
        try:
            handle = self._nixl.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", rows, mem_type.value)
        except Exception as exc:
            raise AgentError(f"preparing a descriptor list for {peer or 'local'}", exc) from exc
        self._dlists.append(handle)
        return handle

    def unprep(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:
            log.warning("releasing a prepped descriptor list: %s", exc)
        if handle in self._dlists:
            self._dlists.remove(handle)

    # ---- transfers --------------------------------------------------------------------------
    def post_prepped(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        nbytes: int,
        descriptors: int,
    ) -> tuple[XferHandle, XferStatus]:
        try:
            raw = self._nixl.make_prepped_xfer(op, local, local_idx, remote, remote_idx)
        except Exception as exc:
            raise AgentError(f"creating a prepped {op}", exc) from exc
        return self._post(raw, op, nbytes, descriptors)

    def post_rows(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        mem_type: MemType,
        nbytes: int,
    ) -> tuple[XferHandle, XferStatus]:
        try:
            raw = self._nixl.initialize_xfer(
                op,
                self._nixl.get_xfer_descs(local, mem_type.value),
                self._nixl.get_xfer_descs(remote, mem_type.value),
                peer,
            )
        except Exception as exc:
            raise AgentError(f"creating a {op}", exc) from exc
        return self._post(raw, op, nbytes, len(local))

    def _post(
        self, raw: Any, op: str, nbytes: int, descriptors: int
    ) -> tuple[XferHandle, XferStatus]:
        handle = XferHandle(raw, nbytes, descriptors)
        self.live_handles += 1
        try:
            state = self._nixl.transfer(raw)
        except Exception as exc:
            self.release(handle)
            raise AgentError(f"posting a {op}", exc) from exc
        status = XferStatus(state)
        if status is XferStatus.ERR:
            self.release(handle)
            raise AgentError(f"posting a {op}", "ERR")
        return handle, status

    def status(self, handle: XferHandle) -> tuple[XferStatus, str]:
        """Drives progress; ``(ERR, NIXL status name)`` when the request failed."""
        try:
            status = XferStatus(self._nixl.check_xfer_state(handle.raw))
        except Exception as exc:
            return XferStatus.ERR, AgentError("checking a transfer", exc).status
        return status, "" if status is not XferStatus.ERR else "ERR"

    def release(self, handle: XferHandle) -> bool:
        """Free (cancel if still in flight) a request. False: NIXL refused, try again later."""
        if handle.released:
            return True
        try:
            handle.raw.release()
        except Exception as exc:
            log.warning("NIXL refused to release a transfer handle (%s); will retry", exc)
            return False
        handle.released = True
        self.live_handles -= 1
        return True

    def telemetry_descriptors(self, handle: XferHandle) -> int | None:
        """Descriptors NIXL actually posted (after its merge); None without telemetry."""
        if not self.config.telemetry:
            return None
        try:
            return int(self._nixl.get_xfer_telemetry(handle.raw).descCount)
        except Exception:
            return None

    # ---- notifications ----------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        try:
            self._nixl.send_notif(peer, message)
        except Exception as exc:
            raise AgentError(f"notifying {peer}", exc) from exc

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(sender agent, message)``; also drives progress."""
        try:
            new = self._nixl.get_new_notifs()
        except Exception as exc:
            log.warning("reading NIXL notifications: %s", exc)
            return []
        return [
            (sender.decode() if isinstance(sender, bytes) else sender, bytes(m))
            for sender, messages in new.items()
            for m in messages
        ]

    # ---- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        for handle in list(self._dlists):
            self.unprep(handle)
        for reg in self._registered:
            try:
                self._nixl.deregister_memory(reg)
            except Exception as exc:
                log.warning("deregistering memory: %s", exc)
        self._registered.clear()
