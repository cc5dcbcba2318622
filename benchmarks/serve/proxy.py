"""The router in front of vLLM's own P/D pairs (``vllm-pull``, ``vllm-push``): one OpenAI
endpoint that turns a completion into vLLM's two legs, the way vLLM's toy proxies do.

``--mode pull`` (NixlConnector; vLLM's ``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``): POST the request to P first with ``stream: false``, ``max_tokens: 1``
and ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
"remote_*": null}``; P answers with its ``kv_transfer_params`` (``do_remote_prefill: true``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``, ...). Then POST the original request with those params to D and
stream D's body back unchanged (D READs the blocks from P, then decodes).

``--mode push`` (NixlPushConnector, vLLM PR #35264): both legs at once. P gets the same P leg
as in pull; D gets the original request with ``kv_transfer_params = {"do_remote_prefill":
true, "do_remote_decode": false, "remote_engine_id": <P's engine_id>, "remote_request_id":
"cmpl-<X-Request-Id>", "remote_host", "remote_port": <P's NIXL side channel>, "tp_size": 1,
"pp_size": 1}`` (P's coordinates come from flags: they are fixed at P's start; D's scheduler
raises KeyError without ``remote_request_id``, and since P runs with
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1`` that is P's exact request id, so D's lease
heartbeats reach P). D allocates blocks and registers them with P over
NIXL; P WRITEs its KV into them when its prefill is done. The two legs carry the same
``X-Request-Id``: vLLM makes it the request id ``cmpl-<id>-<8 hex>`` on each side and the push
worker pairs P's finished request with D's registration by the id without the random suffix.
If the P leg fails, the D leg is cut (D aborts its request) and the client gets the error.

Both modes: one fresh uuid per request as ``X-Request-Id`` on both legs; D's status, content
type and body bytes are passed through. ``GET /health`` is 200 when P and D both answer
their ``/health``; ``GET /v1/models`` is D's; ``GET /proxy/stats`` counts legs and failures,
and ``no_kv_params``: P legs answered 200 without ``kv_transfer_params`` (P kept no blocks for
D, so D computes the prompt itself), and D's answers by the cached prompt tokens of their usage
(``d_loaded`` / ``d_computed`` / ``d_unverified``, ``UsageScanner``: whatever client sent the
load); ``kvpush bench serve`` reads it before and after each point (``checks.py``).

What D reports as cached prompt tokens must be D's own count: vLLM's P adds
``remote_prefill_cached_tokens`` (P's prefix-cache hits) to the ``kv_transfer_params`` it
returns, and a D that receives it reports that number in ``usage.prompt_tokens_details``
instead of its own (``vllm/v1/engine/output_processor.py``, ``RequestState.from_new_request``).
Pull mode drops the field before D's leg (push mode's D params never carry it), so D's usage
shows the tokens it loaded or had cached rather than P's hits; nothing else reads the field.

Threading model: one asyncio loop (aiohttp server + one shared ClientSession without a
connection limit); nothing blocks the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvpush.bench.proxy")

# hop-by-hop or recomputed headers that are not copied from D's answer
_SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}


@dataclass
class Stats:
    requests: int = 0
    prefill_ok: int = 0
    prefill_failed: int = 0
    no_kv_params: int = 0  # P answered 200 without kv_transfer_params (D recomputes)
    decode_ok: int = 0
    decode_failed: int = 0
    # D's answers by the cached prompt tokens in their usage (``checks.cached_rule``): KV
    # loaded, prompt computed by D, or no usage details to tell (any load client)
    d_loaded: int = 0
    d_computed: int = 0
    d_unverified: int = 0


class UsageScanner:
    """Finds the usage of D's answer in the bytes passed through (SSE ``data:`` lines, or a
    JSON body): ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``."""

    def __init__(self) -> None:
        self._pending = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._read(line)

    def end(self) -> dict[str, Any] | None:
        self._read(self._pending)
        self._pending = b""
        return self.usage

    def _read(self, line: bytes) -> None:
        text = line.strip().removeprefix(b"data:").strip()
        if not text.startswith(b"{") or b'"prompt_tokens"' not in text:
            return
        with contextlib.suppress(ValueError):
            usage = json.loads(text).get("usage")
            if isinstance(usage, dict):
                self.usage = usage


@dataclass(frozen=True)
class PrefillPeer:
    """P's NIXL coordinates D needs in push mode (fixed when P starts)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1


class Proxy:
    def __init__(self, mode: str, prefill: str, decode: str, peer: PrefillPeer | None) -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, not {mode!r}")
        if mode == "push" and peer is None:
            raise ValueError("push mode needs P's engine id and side channel")
        self.mode, self.peer = mode, peer
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.stats = Stats()
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/proxy/stats", self.get_stats)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "proxy not started"
        return self._session

    # -- small endpoints ---------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        for base in (self.prefill, self.decode):
            try:
                async with self.session.get(f"{base}/health") as resp:
                    if resp.status != 200:
                        return web.Response(status=503, text=f"{base}: HTTP {resp.status}")
            except (aiohttp.ClientError, OSError) as exc:
                return web.Response(status=503, text=f"{base}: {exc!r}")
        return web.Response(text="ok")

    async def models(self, _request: web.Request) -> web.Response:
        async with self.session.get(f"{self.decode}/v1/models") as resp:
            return web.Response(status=resp.status, body=await resp.read(), headers=_json)

    async def get_stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"mode": self.mode, **asdict(self.stats)})

    # -- the two legs ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        self.stats.requests += 1
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        path = request.path
        if self.mode == "pull":
            status, answer = await self._prefill(path, body, headers)
            if status != 200:
                return web.Response(status=status, body=answer, headers=_json)
            kv = _kv_params(answer)
            if kv:
                kv = {k: v for k, v in kv.items() if k != "remote_prefill_cached_tokens"}
                body = {**body, "kv_transfer_params": kv}
            return await self._stream_decode(request, path, body, headers)

        assert self.peer is not None
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.peer.engine_id,
            # P's own request id (P runs with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1, so it is
            # exactly this): D's scheduler needs the field, and D's lease heartbeats name it
            "remote_request_id": ("chatcmpl-" if "chat" in path else "cmpl-") + request_id,
            "remote_host": self.peer.host,
            "remote_port": self.peer.port,
            "tp_size": self.peer.tp_size,
            "pp_size": 1,
        }
        prefill = asyncio.create_task(self._prefill(path, body, headers))
        decode = asyncio.current_task()
        assert decode is not None

        def on_prefill_done(task: asyncio.Task[tuple[int, bytes]]) -> None:
            if task.cancelled() or task.exception() is not None or task.result()[0] != 200:
                decode.cancel()  # closes the D leg: D aborts the request and frees its blocks

        prefill.add_done_callback(on_prefill_done)
        started: list[web.StreamResponse] = []
        d_body = {**body, "kv_transfer_params": kv}
        try:
            return await self._stream_decode(request, path, d_body, headers, started)
        except asyncio.CancelledError:
            if not prefill.done() or prefill.cancelled():
                raise  # the server stops: not P's failure
            if hasattr(decode, "uncancel"):  # Python >= 3.11
                decode.uncancel()
            status, answer = (502, b"P leg raised") if prefill.exception() else prefill.result()
            log.warning("request %s: P leg failed (HTTP %s); D leg cut", request_id, status)
            if not started:
                return web.Response(status=502 if status == 200 else status, body=answer)
            error = {"error": {"message": f"prefill leg: HTTP {status}", "code": status}}
            with contextlib.suppress(ConnectionError, RuntimeError):
                await started[0].write(b"data: " + json.dumps(error).encode() + b"\n\n")
                await started[0].write_eof()
            return started[0]
        finally:
            if not prefill.done():
                prefill.remove_done_callback(on_prefill_done)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await prefill  # P's blocks are freed when its 1-token request ends

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, bytes]:
        leg = {**body, "stream": False, "max_tokens": 1}
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            leg.pop(key, None)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        try:
            async with self.session.post(self.prefill + path, json=leg, headers=headers) as resp:
                answer = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError) as exc:
            self.stats.prefill_failed += 1
            return 502, json.dumps({"error": f"prefill leg: {exc!r}"}).encode()
        if status == 200:
            self.stats.prefill_ok += 1
            if not _kv_params(answer):
                self.stats.no_kv_params += 1
        else:
            self.stats.prefill_failed += 1
        return status, answer

    async def _stream_decode(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        started: list[web.StreamResponse] | None = None,
    ) -> web.StreamResponse:
        """POST to D and pass its answer through; ``started`` gets the response once its
        headers went out to the client."""
        try:
            async with self.session.post(self.decode + path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    self.stats.decode_failed += 1
                    return web.Response(status=resp.status, body=await resp.read(), headers=_json)
                out = web.StreamResponse(status=200)
                for name, value in resp.headers.items():
                    if name.lower() not in _SKIP_HEADERS:
                        out.headers[name] = value
                await out.prepare(request)
                if started is not None:
                    started.append(out)
                scanner = UsageScanner()
                async for chunk in resp.content.iter_any():
                    scanner.feed(chunk)
                    await out.write(chunk)
                await out.write_eof()
                self.stats.decode_ok += 1
                self._count_usage(scanner.end())
                return out
        except (aiohttp.ClientError, OSError) as exc:
            self.stats.decode_failed += 1
            return web.Response(status=502, text=f"decode leg: {exc!r}")

    def _count_usage(self, usage: dict[str, Any] | None) -> None:
        from kvpush.benchmarks.serve.checks import cached_rule

        details = (usage or {}).get("prompt_tokens_details") or {}
        cached, prompt = details.get("cached_tokens"), (usage or {}).get("prompt_tokens")
        if not isinstance(cached, int) or not isinstance(prompt, int):
            self.stats.d_unverified += 1
        elif cached_rule(prompt, cached):
            self.stats.d_loaded += 1
        else:
            self.stats.d_computed += 1


_json = {"Content-Type": "application/json"}


def _kv_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of P's answer (None when absent or not JSON)."""
    try:
        found = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) and found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpush.benchmarks.serve.proxy")
    parser.add_argument("--mode", choices=("pull", "push"), required=True)
    parser.add_argument("--prefill", required=True, metavar="URL", help="P's base URL")
    parser.add_argument("--decode", required=True, metavar="URL", help="D's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-engine-id", metavar="ID", help="push: P's kv engine_id")
    parser.add_argument(
        "--prefill-side-channel", metavar="HOST:PORT", help="push: P's NIXL side channel"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    peer = None
    if args.mode == "push":
        if not (args.prefill_engine_id and args.prefill_side_channel):
            parser.error("--mode push needs --prefill-engine-id and --prefill-side-channel")
        host, _, port = args.prefill_side_channel.rpartition(":")
        peer = PrefillPeer(args.prefill_engine_id, host, int(port))
    proxy = Proxy(args.mode, args.prefill, args.decode, peer)
    web.run_app(proxy.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
