"""deploy/k8s/base/probe/worker_probe.py, the workers' exec probes, against a real
nats-server and the registry as workers fill it, and with NATS unreachable."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

from kvpush.connector.bus import Bus
from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.workers.registry import Registry
from tests.deploy.layout import PROBE_SCRIPT


def probe_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpush_worker_probe", PROBE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def beat(worker_id: str, *, draining: bool = False) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        role=WorkerRole.DECODE,
        epoch=1,
        model="tiny",
        side_channel="tcp://10.0.0.7:5600",
        in_flight=0,
        queue_depth=0,
        free_blocks=7,
        total_blocks=8,
        sent_at_ms=int(time.time() * 1000),
        draining=draining,
    )


async def test_worker_probe_reads_the_registry_entry(nats_server: Any, bus: Bus) -> None:
    probe = probe_module()
    worker = f"decode-probe-{time.monotonic_ns()}"
    env = {"KVPUSH_NATS_URL": nats_server.url, "KVPUSH_WORKER_ID": worker}

    async def verdicts() -> dict[str, bool]:
        return {mode: (await probe.check(mode, "decode", env))[0] for mode in probe.MODES}

    registry = await Registry.open(bus, 5.0)  # as the first worker creates it
    assert registry is not None
    assert await verdicts() == {"startup": False, "ready": False, "live": False}
    await registry.put(beat(worker))
    assert await verdicts() == {"startup": True, "ready": True, "live": True}
    assert not (await probe.check("ready", "prefill", env))[0]  # another role's key
    await registry.put(beat(worker, draining=True))
    assert await verdicts() == {"startup": True, "ready": False, "live": True}
    # the exec form of the manifests, in a fresh interpreter
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(PROBE_SCRIPT), "live", "decode"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout.startswith("live ok"), done
    await registry.delete(WorkerRole.DECODE, worker)  # stopped (or the TTL dropped it)
    assert await verdicts() == {"startup": False, "ready": False, "live": False}


async def test_worker_probe_passes_liveness_only_when_nats_is_unreachable() -> None:
    probe = probe_module()
    env = {"KVPUSH_NATS_URL": "nats://127.0.0.1:1", "KVPUSH_WORKER_ID": "decode-x"}
    live, ready = await asyncio.gather(
        probe.check("live", "decode", env), probe.check("ready", "decode", env)
    )
    assert live[0] and not ready[0]
    assert "unreachable" in live[1]
    assert probe.main(["ready"], env) == 2  # usage
