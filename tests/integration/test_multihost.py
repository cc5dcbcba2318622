"""Three "hosts" on one machine: network namespaces joined by veth pairs on a bridge.

- ``<ns>-bus``: nats-server and the gateway (10.x.y.2)
- ``<ns>-p``: the prefill worker (10.x.y.3, core 0), its side channel bound to that address
- ``<ns>-d``: the decode worker (10.x.y.4, core 1)

The test process stays in the root namespace (10.x.y.1 on the bridge) and talks HTTP to the
gateway and NATS to the bus like a client on another host. Workers run with ``UCX_TLS=tcp``, so
the KV crosses between namespaces over the veth links (UCX's shared-memory transports would
otherwise take the same-machine shortcut). A request is served token-exact in push and in pull
mode (the reference is the same prompt computed by D alone, mode local; prompts stay under one
128-token block so no prefix cache is involved), and the gateway's metrics show the KV bytes
that crossed. Namespaces, links and processes are removed at the end. Where network namespaces
cannot be made (no ``ip``, no CAP_NET_ADMIN/CAP_SYS_ADMIN) the test FAILS, saying why, unless
``KVPUSH_SKIP_MULTIHOST=1`` opts out: then it is skipped and the skip reason names the variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.integration.http_client import completion_text, metric
from tests.integration.worker_proc import Observer

pytestmark = pytest.mark.engine

PREFIX = "kvpmh"  # every namespace and link of this test starts with it
PORT = 8000
OPT_OUT = "KVPUSH_SKIP_MULTIHOST"  # =1: skip (not fail) where namespaces cannot be made


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def remove_leftovers() -> None:
    """Namespaces and links of an earlier, killed run of this test."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            ip("netns", "del", name, check=False)
    for match in re.finditer(rf"\d+: ({PREFIX}[\w-]*)[@:]", ip("link", check=False).stdout):
        ip("link", "del", match.group(1), check=False)


@dataclass
class Hosts:
    """The three namespaces and the bridge; ``address[name]`` of each, the root's too."""

    subnet: str
    names: dict[str, str] = field(default_factory=dict)  # role -> namespace
    address: dict[str, str] = field(default_factory=dict)  # role -> IPv4
    device: dict[str, str] = field(default_factory=dict)  # role -> interface inside the ns
    bridge: str = f"{PREFIX}-br"

    def exec(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[role]]


def unavailable(why: str) -> None:
    """No namespaces here: a failure, or a skip where the run opted out with ``OPT_OUT``."""
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"{why} ({OPT_OUT}=1: skipped instead of failed)")
    pytest.fail(f"{why}; set {OPT_OUT}=1 to skip this test on such a machine", pytrace=False)


def make_hosts() -> Hosts:
    if shutil.which("ip") is None:
        unavailable("no `ip` command (iproute2): network namespaces unavailable")
    remove_leftovers()
    probe = ip("netns", "add", f"{PREFIX}-probe", check=False)
    if probe.returncode != 0:
        unavailable(f"cannot create network namespaces here: {probe.stderr.strip()}")
    ip("netns", "del", f"{PREFIX}-probe")
    hosts = Hosts(subnet=f"10.{random.randint(200, 250)}.{random.randint(1, 250)}")
    ip("link", "add", hosts.bridge, "type", "bridge")
    ip("addr", "add", f"{hosts.subnet}.1/24", "dev", hosts.bridge)
    ip("link", "set", hosts.bridge, "up")
    hosts.address["root"] = f"{hosts.subnet}.1"
    for n, role in enumerate(("bus", "p", "d"), start=2):
        ns, outer, inner = f"{PREFIX}-{role}", f"{PREFIX}-{role}0", f"{PREFIX}-{role}1"
        ip("netns", "add", ns)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "master", hosts.bridge)
        ip("link", "set", outer, "up")
        ip("link", "set", inner, "netns", ns)
        run = ["netns", "exec", ns, "ip"]
        ip(*run, "addr", "add", f"{hosts.subnet}.{n}/24", "dev", inner)
        ip(*run, "link", "set", inner, "up")
        ip(*run, "link", "set", "lo", "up")
        hosts.names[role], hosts.device[role] = ns, inner
        hosts.address[role] = f"{hosts.subnet}.{n}"
    return hosts


def remove_hosts(hosts: Hosts) -> None:
    for ns in hosts.names.values():
        ip("netns", "del", ns, check=False)
    ip("link", "del", hosts.bridge, check=False)
    remove_leftovers()


class Child:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class Stack:
    hosts: Hosts
    children: list[Child]
    url: str
    nats_url: str


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    made = make_hosts()
    try:
        yield made
    finally:
        remove_hosts(made)
    assert not any(line.startswith(PREFIX) for line in ip("netns", "list").stdout.splitlines())


@pytest.fixture(scope="module")
async def stack(
    hosts: Hosts, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    logs = tmp_path_factory.mktemp("multihost")
    bus_ip, p_ip, d_ip = hosts.address["bus"], hosts.address["p"], hosts.address["d"]
    nats_url = f"nats://{bus_ip}:4222"
    cli = [sys.executable, "-m", "kvpush.services.cli"]
    ucx = {"UCX_TLS": "tcp"}  # UCX over the veth links, not its shared-memory shortcut
    children: list[Child] = []

    def start(role: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        children.append(Child(name, [*hosts.exec(role), *argv], logs / f"{name}.log", env or {}))

    try:
        start("bus", "nats", [*cli, "nats", "--host", bus_ip, "--port", "4222"])
        common = ["--nats-url", nats_url, "--model", str(tiny_model)]
        for role, worker, address, core in (("p", "prefill", p_ip, 0), ("d", "decode", d_ip, 1)):
            name = f"{worker}-mh"
            argv = [*cli, worker, *common, "--id", name, "--cpus", str(core)]
            argv += ["--side-channel-host", address]
            start(role, name, argv, {**ucx, "UCX_NET_DEVICES": hosts.device[role]})
        start("bus", "gateway", [*cli, "gateway", *common, "--host", bus_ip, "--port", str(PORT)])
        url = f"http://{bus_ip}:{PORT}"
        deadline = time.monotonic() + 240
        async with aiohttp.ClientSession() as session:
            while True:
                for child in children:
                    assert child.proc.poll() is None, f"{child.name} exited:\n{child.tail()}"
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with session.get(f"{url}/ready", timeout=aiohttp.ClientTimeout(2)) as r:
                        if r.status == 200:
                            break
                assert time.monotonic() < deadline, "\n".join(c.tail() for c in children)
                await asyncio.sleep(0.5)
        yield Stack(hosts, children, url, nats_url)
    finally:
        for child in reversed(children):
            child.stop()


async def test_workers_sit_on_their_own_hosts(stack: Stack) -> None:
    observer = await Observer.connect(stack.nats_url, "gw-mh-observer")
    try:
        await observer.wait_for(
            lambda: bool(observer.beats.get("prefill-mh") and observer.beats.get("decode-mh")),
            10.0,
            "heartbeats seen from the root namespace",
        )
        for worker, role in (("prefill-mh", "p"), ("decode-mh", "d")):
            side_channel = observer.last_beat(worker).side_channel
            assert side_channel.startswith(f"tcp://{stack.hosts.address[role]}:"), side_channel
    finally:
        await observer.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_request_is_served_token_exact_across_namespaces(stack: Stack, mode: str) -> None:
    prompt = f"Across the veth links, {mode} mode: flitul quean pyst, the plel of stroun"
    received = ("kvpush_gateway_kv_outcomes_total", {"mode": mode, "outcome": "received"})
    before = await metric(stack.url, received[0], **received[1])
    bytes_before = await metric(stack.url, "kvpush_kv_transfer_bytes_total", mode="push")
    got = await completion_text(stack.url, prompt, mode, 12)
    # D got the KV from P (no fallback to computing the prompt itself) ...
    assert await metric(stack.url, received[0], **received[1]) == before + 1
    if mode == "push":  # ... and P reports the bytes it WROTE into D's blocks (KvPushed,
        # which reaches the gateway on its own, around D's first token)
        deadline = time.monotonic() + 30
        pushed = ("kvpush_kv_transfer_bytes_total", {"mode": "push"})
        while await metric(stack.url, pushed[0], **pushed[1]) <= bytes_before:
            assert time.monotonic() < deadline, "no KvPushed bytes counted"
            await asyncio.sleep(0.05)
    reference = await completion_text(stack.url, prompt, "local", 12)
    assert got == reference != ""
