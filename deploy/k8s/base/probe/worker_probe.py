"""Exec probe of a kvpush prefill or decode worker: is its entry in the worker registry live?

Workers serve no HTTP. Each one ``put``s its last ``WorkerHeartbeat`` into the JetStream KV
bucket ``kvpush-workers`` (key ``<role>.<worker id>``, ``kvpush.services.workers.registry``) on
every heartbeat (default every 1 s), first once its engine is up, and the bucket's TTL (5 s)
drops an entry that is not renewed. So the entry says, as the gateways see it, that this worker
is up and beating. The probe reads that one entry:

  startup  the entry exists (the engine is built and the heartbeat loop runs)
  ready    the entry exists and the worker is not draining (it takes new requests)
  live     the entry exists; a NATS that cannot be reached passes (it is not this worker's
           fault, and restarting every worker during a NATS outage would make it worse)

Usage (Kubernetes ``exec`` probe; the container's environment supplies the rest):
  python worker_probe.py startup|ready|live prefill|decode
Reads KVPUSH_WORKER_ID (required: the manifests set it to the pod name), KVPUSH_NATS_URL and
the KVPUSH_NATS_* credentials (``BusConfig.from_env``, like the worker itself). Exit status 0
passes, 1 fails; one line on stdout says why (kubectl describe pod shows it).

This file lives in deploy/k8s/base/probe/ and reaches the pods as the ConfigMap
``kvpush-probe``; tests/integration/test_k8s_worker_probe.py runs it against a real
nats-server.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

MODES = ("startup", "ready", "live")
ROLES = ("prefill", "decode")
TIMEOUT_S = 4.0  # under the probes' timeoutSeconds (5)


async def check(mode: str, role: str, env: Mapping[str, str]) -> tuple[bool, str]:
    """(passed, why) for ``mode`` of the worker named by ``env``."""
    from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError

    from kvpush.connector import Bus, BusConfig, BusConnectError
    from kvpush.schemas import codec, subjects
    from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
    from kvpush.services.workers import registry

    worker_id = env.get("KVPUSH_WORKER_ID", "")
    if not worker_id:
        return False, "KVPUSH_WORKER_ID is not set"
    url = env.get("KVPUSH_NATS_URL") or "nats://127.0.0.1:4222"
    config = BusConfig.from_env(
        url,
        f"kvpush-probe-{worker_id}",
        env=env,
        connect_timeout_s=2.0,
        initial_connect_timeout_s=TIMEOUT_S - 1.0,
    )
    try:
        bus = await Bus.connect(config)
    except BusConnectError as exc:
        return mode == "live", f"NATS unreachable: {exc}"
    try:
        key = registry.key(WorkerRole(role), worker_id)
        try:
            kv = await bus.client.jetstream().key_value(registry.BUCKET)
            entry = await kv.get(key)
        except BucketNotFoundError:
            return False, f"no registry bucket {registry.BUCKET!r} (JetStream off?)"
        except (KeyNotFoundError, KeyDeletedError):
            return False, f"no live registry entry {key!r}: not started, or heartbeats stopped"
        beat = codec.decode(subjects.heartbeat(WorkerRole(role), worker_id), entry.value or b"")
        if not isinstance(beat, WorkerHeartbeat):
            return False, f"registry entry {key!r} is not a heartbeat"
        if mode == "ready" and beat.draining:
            return False, f"{key} is draining"
        return True, (
            f"{key} epoch {beat.epoch}: in flight {beat.in_flight}, "
            f"free blocks {beat.free_blocks}/{beat.total_blocks}, draining {beat.draining}"
        )
    finally:
        await bus.close()


def main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    if len(argv) != 2 or argv[0] not in MODES or argv[1] not in ROLES:
        print(f"usage: worker_probe.py {'|'.join(MODES)} {'|'.join(ROLES)}")
        return 2
    mode, role = argv
    try:
        passed, why = asyncio.run(asyncio.wait_for(check(mode, role, env or os.environ), TIMEOUT_S))
    except asyncio.TimeoutError:
        passed, why = mode == "live", f"no answer from NATS within {TIMEOUT_S} s"
    print(f"{mode} {'ok' if passed else 'FAILED'}: {why}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
