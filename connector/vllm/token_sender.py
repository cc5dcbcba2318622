"""P's first token, sent to D from the engine-core process the moment the step's outputs exist.

With the engine core in a process of its own (``engine_core.py``), the token P sampled reached
D only after a round through the prefill worker: vLLM's output socket, the worker's ``AsyncLLM``
client and its asyncio loop, then the worker's bus (6 ms at concurrency 1 on the H200, more
with the worker's loop busy). ``FirstTokenSender`` sends ``FirstToken`` on
``kvpush.v1.kv.done.<D>`` from the prefill engine's scheduler instead, right after the step's
``update_from_output``, for every request whose transfer parameters ask for P's token
(``first_token_from_prefill``), over a NATS connection of its own (opened with the engine).
The prefill worker then sends none itself.

What it sends is how the engine ended P's one-token request: ``stop`` for an end of sequence or
a stop token (``stop_reason`` the token id or None); a stop string is the detokenizer's to find,
and D's detokenizer checks P's token as the answer's first output, so nothing is lost.

Threading model: ``watch``, ``send`` and ``forget`` run on the engine core's scheduler thread;
publishing is the ``BusThread``'s (one asyncio thread, started with the engine).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from kvpush.connector.bus import BusConfig
from kvpush.connector.params import ConnectorSettings, TransferParams, read_params
from kvpush.connector.vllm.runtime import BusThread
from kvpush.schemas import subjects
from kvpush.schemas.messages import FinishReason, FirstToken


class FirstTokenSender:
    """The prefill engine's sender of P's first tokens (module docstring)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        name = f"kvpush-{settings.worker_id}-first-tokens"
        self._bus = BusThread(BusConfig.from_env(settings.nats_url, name))
        self._wanted: dict[str, TransferParams] = {}  # req_id -> params, until its last output

    def watch(self, request: Any) -> None:
        """A request was added: remember it if D wants P's token of it."""
        params = read_params(request.kv_transfer_params)
        if params is not None and params.first_token_from_prefill:
            self._wanted[request.request_id] = params

    def send(self, outputs: Mapping[int, Any]) -> None:
        """Send the token of every watched request that ended in this step's ``outputs``
        (vLLM's ``EngineCoreOutputs`` by client)."""
        if not self._wanted:
            return
        for batch in outputs.values():
            for output in batch.outputs:
                if output.finish_reason is None or output.request_id not in self._wanted:
                    continue
                params = self._wanted.pop(output.request_id)
                if output.new_token_ids and output.finish_reason.name in ("STOP", "LENGTH"):
                    self._publish(params, output)

    def forget(self, live: Container[str]) -> None:
        """Drop the watched requests that ended without a token (aborted)."""
        for req_id in [r for r in self._wanted if r not in live]:
            del self._wanted[req_id]

    def _publish(self, params: TransferParams, output: Any) -> None:
        stopped = output.finish_reason.name == "STOP"
        stop = output.stop_reason if stopped else None
        token = FirstToken(
            transfer_id=params.transfer_id,
            prefill_id=params.prefill_id,
            decode_id=params.decode_id,
            token_id=output.new_token_ids[0],
            finish_reason=FinishReason.STOP if stopped else None,
            stop_reason=stop[:256] if isinstance(stop, str) else stop,
        )
        self._bus.publish(subjects.kv_done(params.decode_id), token, span=False)

    def close(self) -> None:
        self._bus.close()
