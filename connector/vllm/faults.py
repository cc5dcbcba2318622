"""``SlowPrefillConnector``: the kvpush connector with injected faults, for tests and soak runs.

The production connector (``connector.KVPushConnector``) carries no fault hooks. This subclass
reads its faults from ``kv_connector_extra_config`` (keys in ``FAULT_KEYS``, which the
production settings never see) and applies them around the real code:

- ``fault_layer_delay_ms``: P sleeps this long after computing each layer of a kvpush request's
  last prefill step (a slow prefill), widening every race window between the push, aborts and
  the request's end.
- ``fault_step_delay_ms``: every forward step of the engine sleeps this long first (a slow
  decode), so a worker can be killed or stopped while an answer streams.

Load it like the production one (``kv_connector: SlowPrefillConnector``,
``kv_connector_module_path: kvpush.connector.vllm.faults``); ``kvpush.services.workers`` does
so when a fault is configured (``KVPUSH_FAULT_LAYER_DELAY_MS``, ``KVPUSH_FAULT_STEP_DELAY_MS``).

Threading model: as ``KVPushConnector`` (the sleep runs on the worker thread, as the compute
it stands for would).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvpush.connector.params import ConnectorSettings
from kvpush.connector.vllm.connector import KVPushConnector

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

FAULT_KEYS = ("fault_layer_delay_ms", "fault_step_delay_ms")


class SlowPrefillConnector(KVPushConnector):
    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.layer_delay_s = float(extra.get("fault_layer_delay_ms", 0.0)) / 1000.0
        self.step_delay_s = float(extra.get("fault_step_delay_ms", 0.0)) / 1000.0

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
