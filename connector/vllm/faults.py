"""``SlowPrefillConnector``: the kvpush connector with injected faults, for tests and soak runs.

The production connector (``connector.KVPushConnector``) carries no fault hooks. This subclass
reads its faults from ``kv_connector_extra_config`` (keys in ``FAULT_KEYS``, which the
production settings never see) and applies them around the real code:

- ``fault_layer_delay_ms``: P sleeps this long after computing each layer of a kvpush request's
  last prefill step (a slow prefill), widening every race window between the push, aborts and
  the request's end.
- ``fault_step_delay_ms``: every forward step of the engine sleeps this long first (a slow
  decode), so a worker can be killed or stopped while an answer streams.
- ``fault_corrupt_prefix``: P of a transfer whose id starts with this flips the lowest bit of
  one KV element (of the first block it sends) after the KV checksum was taken and before D
  gets the bytes: push, of the last layer, just before its WRITE is posted (P takes the
  checksum once every layer is computed: earlier layers' WRITEs go before it); pull, of every
  layer, just before KvReady goes out. Bytes corrupted in flight, as far as D can tell.
- ``fault_stale_write_prefix``: P of such a push, before its last layer's WRITE, WRITEs layer 0
  once more into D's blocks from a stale sender (a transfer of its own that names the request's
  transfer id with an older allocation epoch): the request's own blocks in reverse order, i.e.
  misplaced KV landing after the real WRITE, and a done notice D must drop as another
  allocation's.

Load it like the production one (``kv_connector: SlowPrefillConnector``,
``kv_connector_module_path: kvpush.connector.vllm.faults``); ``kvpush.services.workers`` does
so when a fault is configured (``KVPUSH_FAULT_LAYER_DELAY_MS``, ``KVPUSH_FAULT_STEP_DELAY_MS``).

Threading model: as ``KVPushConnector`` (the sleep runs on the worker thread, as the compute
it stands for would). The KV faults run where the prefill side posts WRITEs and publishes
(engine, gate or bus thread), under its lock; the stale WRITE waits for its own completion.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvpush.connector.integrity import int_rows
from kvpush.connector.layout import ids_to_runs
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.transfer import LegSpec, TransferState
from kvpush.connector.vllm.connector import KVPushConnector
from kvpush.connector.vllm.outgoing import Outgoing
from kvpush.schemas.messages import KvReady

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

FAULT_KEYS = (
    "fault_layer_delay_ms",
    "fault_step_delay_ms",
    "fault_corrupt_prefix",
    "fault_stale_write_prefix",
)
STALE_WRITE_WAIT_S = 10.0


class SlowPrefillConnector(KVPushConnector):
    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.layer_delay_s = float(extra.get("fault_layer_delay_ms", 0.0)) / 1000.0
        self.step_delay_s = float(extra.get("fault_step_delay_ms", 0.0)) / 1000.0
        self.corrupt_prefix = str(extra.get("fault_corrupt_prefix") or "")
        self.stale_prefix = str(extra.get("fault_stale_write_prefix") or "")
        self._flipped: set[str] = set()  # pushes corrupted (one flip each, not one per leg)
        self._post: Any = None
        self._publish: Any = None

    @classmethod
    def settings_from(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        kept = {k: v for k, v in (extra or {}).items() if k not in FAULT_KEYS}
        return super().settings_from(kept)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        super().start_load_kv(forward_context, **kwargs)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        prefill = self.worker_half.prefill if self.worker_half is not None else None
        if self.layer_delay_s and prefill is not None and prefill.completing:
            time.sleep(self.layer_delay_s)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    # ---- KV faults (prefill) ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        half = self.worker_half
        if half is None or half.prefill is None or not (self.corrupt_prefix or self.stale_prefix):
            return
        assert half.transport is not None and half.bus is not None
        self._post, self._publish = half.transport.push_layers, half.bus.publish
        half.transport.push_layers = self._push_layers  # type: ignore[method-assign]
        half.bus.publish = self._publish_faulty  # type: ignore[method-assign]

    def _outgoing(self, transfer_id: str) -> Outgoing | None:
        assert self.worker_half is not None and self.worker_half.prefill is not None
        return self.worker_half.prefill._by_tid.get(transfer_id.split(">")[0])

    def _push_layers(self, transport_id: str, layers: Any) -> bool:
        out = self._outgoing(transport_id)
        tid = out.params.transfer_id if out is not None else ""
        last = self.worker_half.prefill.num_layers - 1  # type: ignore[union-attr]
        corrupt = bool(self.corrupt_prefix) and tid.startswith(self.corrupt_prefix)
        if out is not None and corrupt and last in layers and tid not in self._flipped:
            self._flipped.add(tid)  # a second leg's flip would undo the first
            self._flip(out, last)
        stale = out is not None and bool(self.stale_prefix) and tid.startswith(self.stale_prefix)
        if stale and last in layers and 0 not in layers:  # layer 0's WRITE went before
            self._stale_write(out, transport_id)  # type: ignore[arg-type]
        return self._post(transport_id, layers)

    def _publish_faulty(self, subject: str, message: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, KvReady) and self.corrupt_prefix:
            out = self._outgoing(message.transfer_id)
            if out is not None and message.transfer_id.startswith(self.corrupt_prefix):
                for layer in range(self.worker_half.prefill.num_layers):  # type: ignore[union-attr]
                    self._flip(out, layer)
        return self._publish(subject, message, *args, **kwargs)

    def _flip(self, out: Outgoing, layer: int) -> None:
        """Flip the lowest bit of the first element of the first block P sends of ``layer``. On
        CUDA after the block sums of every layer ran (one pass on their side stream: queued,
        not yet run, it would take the flipped bit in) and before the WRITE is posted (NIXL
        reads the memory, not in stream order)."""
        half = self.worker_half
        assert half is not None and half.transport is not None and half.prefill is not None
        announced = next(iter(out.announcements.values()), None)
        first = announced.first_token // half.block_size if announced is not None else 0
        region = half.transport.layout.layers[layer][0]
        rows = int_rows(half.kv_layers[layer], region)
        sums = half.prefill.kv_sums
        if sums is not None and sums.side_stream is not None:
            sums.side_stream.synchronize()
        rows[out.block_ids[first], 0] ^= 1
        if rows.device.type == "cuda":
            import torch

            torch.cuda.current_stream(rows.device).synchronize()

    def _stale_write(self, out: Outgoing, transport_id: str) -> None:
        """WRITE layer 0 again, into the same blocks of D, from our blocks in reverse order, as
        a stale sender of an older allocation; return once it is DONE (and after the real
        layer-0 WRITE is, so the stale one lands last)."""
        half = self.worker_half
        assert half is not None and half.transport is not None
        transport = half.transport
        ann = next(iter(out.announcements.values()))
        first, last = ann.first_token // half.block_size, -(-out.num_tokens // half.block_size)
        deadline = time.monotonic() + STALE_WRITE_WAIT_S
        while time.monotonic() < deadline:  # the real layer 0 landed
            with transport._lock:
                t = transport._engine.transfers.get(transport_id)
                if t is None or all(p.done for p in t.requests):
                    break
            time.sleep(0.005)
        stale_id = f"{out.params.transfer_id}-stale"
        spec = LegSpec(out.params.transfer_id, alloc=max(1, ann.alloc_epoch - 1))
        local = ids_to_runs(out.block_ids[first:last][::-1])
        transport.start_push(
            stale_id, ann.side_channel, ann.block_runs, local, 5.0, ann.decode_epoch, spec
        )
        self._post(stale_id, [0])
        transport.finish(stale_id)
        while time.monotonic() < deadline and transport.state(stale_id) is not TransferState.DONE:
            time.sleep(0.005)
