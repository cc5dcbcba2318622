"""``KVPushConnector``: the vLLM ``KVConnectorBase_V1`` facade of kvpush (push and pull).

Load it without patching vLLM::

    kv_transfer_config = {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.connector.vllm.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_load_failure_policy": "recompute",   # decode falls back to local prefill
        "kv_connector_extra_config": {"worker_id": "d0", "role": "decode",
                                      "nats_url": "nats://127.0.0.1:4222"},
    }

Requests opt in with ``kv_transfer_params = TransferParams(...).to_params()``; others run as on
a plain engine. vLLM builds one instance per role: the scheduler role (one per engine, in the
engine core's process) delegates to ``SchedulerHalf`` (bookkeeping, the driver's contact point),
the worker role (one per TP rank, wherever vLLM runs that rank) to ``WorkerHalf`` (NIXL + bus).

Each instance first sets its process's GIL switch interval (``kvpush.connector.switching``,
from ``KVPUSH_GIL_SWITCH_US``, which the worker's environment passes down): vLLM builds one in
the engine-core process and in every TP rank's, processes that kvpush starts no code in.

Threading model: vLLM calls each instance from its engine thread (scheduler or worker); the
worker half owns a poller thread and a bus thread (see ``runtime``), the scheduler half a
wake-up listener thread (see ``wake``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpush.connector.params import ConnectorSettings
from kvpush.connector.switching import apply_switch_interval
from kvpush.connector.tracing import configure_tracing_from_env
from kvpush.connector.vllm import compat
from kvpush.connector.vllm.metadata import KVPushHandshake, KVPushMetadata, KVPushWorkerMeta
from kvpush.connector.vllm.scheduler import SchedulerHalf
from kvpush.connector.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


class KVPushConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        compat.check_version()
        try:  # this engine process's switch interval (the worker's own is set at its start)
            apply_switch_interval()
        except ValueError as exc:  # only an engine no kvpush worker started gets here
            logging.getLogger(__name__).warning("%s: CPython's interval stays", exc)
        self._load_errors: set[int] = set()  # vLLM 0.26: blocks of failed receives, this step
        transfer_config = vllm_config.kv_transfer_config
        settings = self.settings_from(transfer_config.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        # An engine in its own process traces only if the worker passed KVPUSH_TRACE_FILE or
        # OTEL_* down; in the worker's process this finds the provider already installed.
        configure_tracing_from_env(f"kvpush-{settings.role.value}")
        engine_id = str(transfer_config.engine_id)
        # what an in-process driver (kvpush.connector.EngineLink) and the worker extension of an
        # engine-core process (engine_core.KVPushWorkerExtension) read: one of them is None
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            max_model_len = vllm_config.model_config.max_model_len
            self.scheduler_half = SchedulerHalf(settings, block_size, engine_id, max_model_len)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            model = vllm_config.model_config
            model_id = settings.model_id or str(model.served_model_name or model.model)
            self.worker_half = WorkerHalf(
                settings,
                model_id,
                str(model.dtype),
                block_size,
                engine_id,
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
            )

    @classmethod
    def settings_from(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The connector's settings from ``kv_connector_extra_config`` (unknown keys refused)."""
        return ConnectorSettings.from_extra_config(extra)

    # ---- worker role ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_half is not None
        self.worker_half.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_half is not None and isinstance(connector_metadata, KVPushMetadata):
            self.worker_half.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # receives are driven by the transport, not by the forward pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self.worker_half is not None:
            self.worker_half.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        # pushes are asynchronous (their source blocks stay held: delay_free); on a GPU this
        # waits until the step's last layer ran and was handed to the push
        if self.worker_half is not None:
            self.worker_half.wait_for_save()

    def get_handshake_metadata(self) -> KVPushHandshake | None:
        """This rank's identity for the scheduler half (vLLM collects it after registration)."""
        info = self.worker_half.runtime.info if self.worker_half is not None else None
        return KVPushHandshake(info) if info is not None else None

    def build_connector_worker_meta(self) -> KVPushWorkerMeta | None:
        """This rank's timing marks of the step and P's first tokens of the receives it
        reported finished, for the scheduler half."""
        return self.worker_half.worker_meta() if self.worker_half is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.26's per-step question; a failed receive is finished with invalid blocks."""
        sending, recving, failed_blocks = self._results(finished_req_ids)
        self._load_errors = set().union(*failed_blocks.values()) if failed_blocks else set()
        return sending or None, (recving | set(failed_blocks)) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's per-step question (``KVConnectorTransferResults``)."""
        sending, recving, failed_blocks = self._results(finished_req_ids)
        return compat.transfer_results(sending, recving | set(failed_blocks), set(failed_blocks))

    def _results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], dict[str, list[int]]]:
        if self.worker_half is None:
            return set(), set(), {}
        return self.worker_half.transfer_results(finished_req_ids)

    # ---- scheduler role -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler_half is not None
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler_half is not None
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler_half is not None
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_half is not None:
            self.scheduler_half.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_half is not None
        return self.scheduler_half.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.scheduler_half is not None:
            self.scheduler_half.set_handshakes(metadata)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_half is not None and self.scheduler_half.has_pending_push_work()

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.shutdown()
        if self.scheduler_half is not None:
            self.scheduler_half.shutdown()
