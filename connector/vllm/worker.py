"""Worker half of ``KVPushConnector``: registers the KV cache with NIXL and drives transfers.

``register_kv_caches`` registers each layer's KV tensor as one NIXL region, starts the side
channel and a ``Poller`` thread (progress without a NIXL progress thread) and joins the bus. Then,
every engine step: ``bind`` hands this step's ``KVPushMetadata`` to the prefill or decode side,
``save_kv_layer`` pushes a layer the moment it is computed (prefill, push mode; with the
KV in GPU memory once the GPU ran it: ``gate.LayerGate``, drained by ``wait_for_save``), and
``transfer_results`` drains transport events into vLLM's finished_sending / finished_recving /
failed_recving sets. The protocol itself lives in ``prefill_side.py`` and ``decode_side.py``.
With the KV checksum on (``kv_checksum``, the default) the registered tensors also get a
``KvSums`` view (integrity.py): P counts each layer in ``save_kv_layer`` before the layer is
handed on and takes every layer's block sums in one pass with the last one, D verifies what
landed before a receive is reported.

With tensor parallelism there is one worker half per TP rank, each with its own NIXL agent,
side channel and bus connection; rank r pairs with rank r of the peer (``rank`` on every bus
message of a transfer). The half owns its rank's ``WorkerRuntime`` (wake-up line, suspects,
timing marks, ``info``) and ``BusThread``; what the driver must learn goes up through vLLM:
``handshake`` (this rank's ``ConnectorInfo``, once) and ``worker_meta`` (timing marks and P's
first tokens, each step).

Threading model: vLLM calls every method on its worker thread. The Poller thread only queues
transport events (and sets ``runtime.activity``); the bus thread calls the sides' ``on_bus``;
on a GPU the gate's thread calls the prefill side's ``on_layer_saved``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from typing import Any

from kvpush.connector.bus import BusConfig
from kvpush.connector.integrity import KvSums
from kvpush.connector.layout import MemType, pool_layout
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.peering import HEAD_MAJOR_LAYOUTS, CompatInfo, paged_layout_name
from kvpush.connector.poller import Poller, worker_intervals
from kvpush.connector.transfer import TransferEvent
from kvpush.connector.transport import KvTransport, TransportConfig
from kvpush.connector.vllm.decode_side import DecodeSide
from kvpush.connector.vllm.gate import LayerGate
from kvpush.connector.vllm.metadata import KVPushMetadata, KVPushWorkerMeta
from kvpush.connector.vllm.prefill_side import PrefillSide
from kvpush.connector.vllm.runtime import BusThread, ConnectorInfo, WorkerRuntime
from kvpush.connector.vllm.side import Rank
from kvpush.connector.vllm.wake import WakeSender
from kvpush.schemas.messages import WorkerRole

log = logging.getLogger(__name__)
SIDE_CHANNEL_TOKEN_ENV = "KVPUSH_SIDE_CHANNEL_TOKEN"  # shared secret of every P and D


class WorkerHalf:
    def __init__(
        self,
        settings: ConnectorSettings,
        model_id: str,
        dtype: str,
        block_size: int,
        engine_id: str,
        rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.settings = settings
        self.model_id = model_id
        self.dtype = dtype
        self.block_size = block_size
        self.rank = rank
        self.tp_size = tp_size
        self.transport: KvTransport | None = None
        self.poller: Poller | None = None
        self._waker = WakeSender(engine_id)
        self.runtime = WorkerRuntime(self._waker.notify)
        self.bus: BusThread | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._layer_index: dict[str, int] = {}
        self.kv_layers: list[Any] = []  # the registered KV tensor of each layer, in order
        self._gate: LayerGate | None = None  # KV in GPU memory: push a layer once it is written
        self._handed_over: set[int] = set()  # layers of this step's forward handed to the sides
        # decode: every KV integrity count this rank sent up so far (the scheduler half's are
        # the ranks' sum: what a driver in another process asks for, ``kvpush_integrity_counts``)
        self.integrity_totals: Counter[str] = Counter()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.kv_layers = [kv_caches[name] for name in names]
        layout = pool_layout([[tensor] for tensor in self.kv_layers])
        compat = CompatInfo(
            model=self.model_id,
            dtype=self.dtype,
            block_size=self.block_size,
            layout=paged_layout_name(tuple(kv_caches[names[0]].stride())),
        )
        s = self.settings
        rank_id = s.worker_id if self.tp_size == 1 else f"{s.worker_id}-tp{self.rank}"
        self.transport = KvTransport(
            TransportConfig(
                worker_id=rank_id,
                compat=compat,
                host=s.side_channel_host,
                port=s.side_channel_port + self.rank if s.side_channel_port else 0,
                advertise_host=s.advertise_host,
                backend_params={"ucx_error_handling_mode": s.ucx_error_handling_mode},
                token=os.environ.get(SIDE_CHANNEL_TOKEN_ENV) or None,
            ),
            layout,
        )
        rt = self.runtime
        intervals = worker_intervals(s.role is WorkerRole.DECODE, layout.mem_type is MemType.VRAM)
        self.poller = Poller(self.transport, **intervals, on_events=rt.notify)
        self.bus = BusThread(BusConfig.from_env(s.nats_url, f"kvpush-{rank_id}"))
        rank = Rank(self.rank, self.tp_size)
        sums = None
        if s.kv_checksum:  # a block splits into its KV heads where they are contiguous
            heads = self.kv_layers[0].shape[1] if compat.layout in HEAD_MAJOR_LAYOUTS else 1
            try:
                sums = KvSums(layout, [[tensor] for tensor in self.kv_layers], heads)
            except ValueError as exc:
                raise ValueError(f"kvpush KV checksum: {exc} (--kv-checksum off: none)") from exc
        if s.role is WorkerRole.PREFILL:
            self.prefill = PrefillSide(
                s, self.transport, self.bus, rt, rank, len(names), self.block_size, sums
            )
            if layout.mem_type is MemType.VRAM:
                self._gate = LayerGate(self._layer_ready, self.kv_layers[0].device)
        else:
            self.decode = DecodeSide(s, self.transport, self.bus, rt, rank, self.block_size, sums)
        rt.info = ConnectorInfo(
            s.worker_id,
            s.role.value,
            self.transport.address,
            self.transport.compat_hash,
            self.rank,
            self.tp_size,
        )
        log.info(
            "kvpush %s %s rank %d/%d: %d layers registered, side channel %s",
            s.role.value,
            s.worker_id,
            self.rank,
            self.tp_size,
            len(names),
            self.transport.address,
        )

    def bind(self, meta: KVPushMetadata) -> None:
        if self._gate is not None:  # the last step's recorded layers all handed on before
            self._gate.drain()  # this step's work replaces them
        self._handed_over.clear()
        for address in meta.suspects:
            self.runtime.suspect_peer(address)
        if self.prefill is not None:
            self.prefill.on_work(meta.prefill)
        elif self.decode is not None and meta.decode:
            self.decode.on_work(meta.decode)

    def save_kv_layer(self, layer_name: str) -> None:
        if self.prefill is None or not self.prefill.completing:
            return
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._hand_over(index)

    def _hand_over(self, index: int) -> None:
        """Layer ``index`` of this step's forward is enqueued: count it in for the KV checksum,
        then pass it on."""
        assert self.prefill is not None
        self._handed_over.add(index)
        self.prefill.on_layer_computed(index)  # the last one queues every layer's sums before
        # it is handed on (on CUDA: behind an event of the forward's stream, on the side stream)
        if self._gate is not None:
            self._gate.record(index)  # on the GPU: posted once the layer ran
        else:
            self._layer_ready(index)

    def _layer_ready(self, index: int) -> None:
        if self.prefill is not None and self.prefill.on_layer_saved(index) and self.poller:
            self.poller.wake()  # WRITEs posted: poll them to completion now

    def wait_for_save(self) -> None:
        """After the forward: every computed layer of this step was handed to the sides.

        A forward that vLLM replays as one whole CUDA graph (its FULL graphs, taken for a batch
        of one-token queries: a prompt P holds in its prefix cache but for its last token) runs
        no ``save_kv_layer``: its layers are handed over here, behind the whole forward on the
        stream (a pull's KvReady and a push's WRITEs waited for them forever). Only a forward
        that handed over no layer and raised nothing (vLLM calls this from a ``finally``): one
        that failed part-way computed no KV to send."""
        skipped = self.prefill is not None and self.prefill.completing and not self._handed_over
        if skipped and sys.exc_info()[1] is None:
            for index in range(len(self._layer_index)):
                self._hand_over(index)
        if self._gate is not None:
            self._gate.drain()

    def _drain(self) -> list[TransferEvent]:
        events: list[TransferEvent] = []
        while self.poller is not None and not self.poller.events.empty():  # we take, alone
            events.append(self.poller.events.get_nowait())
        return events

    def transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], dict[str, list[int]]]:
        """(finished_sending, finished_recving, failed receives with their block ids) for this
        step; a failed receive is not in finished_recving (the facade reports it per version)."""
        events = self._drain()
        if self.prefill is not None:
            released = self.prefill.collect(finished_req_ids, events)
            if released:
                # vLLM frees these blocks after this step's schedule(): requests waiting for
                # blocks get them only in the next step, which an idle driver must not sleep off
                self.runtime.notify()
            return released, set(), {}
        if self.decode is not None:
            recving, failed = self.decode.collect(events)
            if recving or failed:
                # vLLM schedules these requests on the *next* step: a driver that saw this step
                # idle must step again at once instead of sleeping (found via the breakdown:
                # D's first step was 50 ms late, EngineHost's idle wait).
                self.runtime.notify()
            return set(), recving, failed
        return set(), set(), {}

    def worker_meta(self) -> KVPushWorkerMeta | None:
        """The timing marks learned since the last step, P's first tokens of the receives this
        step reported finished (the scheduler half continues those requests from them) and the
        KV integrity outcomes since the last step."""
        marks = self.runtime.marks.take_all()
        tokens = self.decode.take_first_tokens() if self.decode is not None else {}
        counts, outcomes = self.decode.integrity.take() if self.decode is not None else ({}, {})
        self.integrity_totals.update(counts)
        if not (marks or tokens or counts):
            return None
        return KVPushWorkerMeta({tid: [t] for tid, t in marks.items()}, tokens, counts, outcomes)

    def shutdown(self) -> None:
        if self._gate is not None:
            self._gate.close()
        self.runtime.timer.close()
        self._waker.close()
        if self.poller is not None:
            self.poller.stop()
        if self.transport is not None:
            self.transport.close()
        if self.bus is not None:
            self.bus.close()
