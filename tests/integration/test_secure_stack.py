"""The stack on a NATS server that requires TLS and a password (deploy/nats/secure.conf).

A CA and a server certificate are made here; nats-server runs with the deploy file rendered
with them. Then:
- a client without credentials, with a wrong password, or without TLS cannot connect (so it
  cannot publish a request); the read-only ``observer`` user connects but its publish on a
  request subject never reaches a subscriber;
- ``kvpush up --nats tls://...`` with the credentials in KVPUSH_NATS_* serves a push request
  whose answer equals D's own computation of the prompt (mode local).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import secrets
import signal
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvpush.connector.bus import Bus, BusConfig, BusConnectError
from kvpush.schemas import subjects
from kvpush.services.natsd import EmbeddedNats
from tests.integration.http_client import completion_text

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a throwaway CA and a server cert for 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpush test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@dataclass
class SecureNats:
    server: EmbeddedNats
    url: str  # tls://127.0.0.1:PORT
    ca: Path
    password: str
    observer_password: str


@pytest.fixture(scope="module")
def secure_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    folder = tmp_path_factory.mktemp("secure-nats")
    ca, cert, key = make_certs(folder)
    password, observer = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    template = string.Template((ROOT / "deploy/nats/secure.conf").read_text())
    conf = folder / "nats.conf"
    rendered = template.safe_substitute(
        NATS_TLS_CERT=cert,
        NATS_TLS_KEY=key,
        NATS_TLS_CA=ca,
        NATS_STORE_DIR=folder / "js",
        KVPUSH_PASSWORD=password,
        OBSERVER_PASSWORD=observer,
    )  # safe_: "$JS.API.>" and "$KV.>" are NATS subjects, not placeholders
    assert "$NATS_" not in rendered and '_PASSWORD"' not in rendered
    conf.write_text(rendered)
    server = EmbeddedNats(jetstream=False, extra_args=("-c", str(conf)))  # it turns JetStream on
    server.start()
    try:
        yield SecureNats(server, f"tls://127.0.0.1:{server.port}", ca, password, observer)
    finally:
        server.stop()


async def connect(url: str, **fields: object) -> Bus:
    config = BusConfig(url=url, name="t", initial_connect_timeout_s=3.0, **fields)  # type: ignore[arg-type]
    return await Bus.connect(config)


async def test_only_authenticated_tls_clients_get_in(secure_nats: SecureNats) -> None:
    s = secure_nats
    plain = s.url.replace("tls://", "nats://")
    refused = [
        (s.url, {"tls_ca_file": str(s.ca)}),  # no credentials
        (s.url, {"tls_ca_file": str(s.ca), "user": "kvpush", "password": "wrong"}),
        (plain, {"user": "kvpush", "password": s.password}),  # no TLS
    ]
    for url, fields in refused:
        with pytest.raises(BusConnectError):
            await connect(url, **fields)
    good = await connect(s.url, tls_ca_file=str(s.ca), user="kvpush", password=s.password)
    observer = await connect(
        s.url, tls_ca_file=str(s.ca), user="observer", password=s.observer_password
    )
    try:
        seen: list[str] = []

        async def on_raw(msg: object) -> None:
            seen.append(msg.data.decode())  # type: ignore[attr-defined]

        await good.client.subscribe("kvpush.v1.req.>", cb=on_raw)
        await good.flush()
        await observer.client.publish(subjects.request("p0", "d0"), b"from-observer")
        await good.client.publish(subjects.request("p0", "d0"), b"from-kvpush")
        await good.flush()
        deadline = time.monotonic() + 5
        while "from-kvpush" not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert seen == ["from-kvpush"]  # the observer's publish was refused by the server
    finally:
        await observer.close()
        await good.close()


async def test_the_stack_serves_over_tls_with_credentials(
    secure_nats: SecureNats, tiny_model: Path, tmp_path: Path
) -> None:
    s = secure_nats
    env = {
        **os.environ,
        "KVPUSH_NATS_USER": "kvpush",
        "KVPUSH_NATS_PASSWORD": s.password,
        "KVPUSH_NATS_TLS_CA": str(s.ca),
        "KVPUSH_SIDE_CHANNEL_TOKEN": secrets.token_urlsafe(24),
    }
    argv = [sys.executable, "-m", "kvpush.services.cli", "up", "--nats", s.url]
    argv += ["--model", str(tiny_model), "--port", "0", "--log-dir", str(tmp_path)]
    out = tmp_path / "up.out"
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while "kvpush is up" not in out.read_text(errors="replace"):
            assert proc.poll() is None, out.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
            await asyncio.sleep(0.3)
        banner = re.search(r"kvpush is up: (http://\S+:\d+)/v1", out.read_text(errors="replace"))
        assert banner, out.read_text(errors="replace")[-3000:]
        url = banner.group(1)  # the port up bound (--port 0: its pick)
        prompt = "Over TLS with a password: flitul quean pyst, the plel of stroun"
        pushed = await completion_text(url, prompt, "push", 10)
        assert pushed == await completion_text(url, prompt, "local", 10) != ""
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        assert 'kvpush_gateway_kv_outcomes_total{mode="push",outcome="received"} 1.0' in metrics
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out.read_text(errors="replace")[-3000:]
