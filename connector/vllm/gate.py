"""``LayerGate``: on a GPU, a layer's KV may be pushed only once the GPU has written it.

``save_kv_layer`` runs on the forward thread as soon as vLLM *enqueued* a layer's attention, long
before the GPU ran it. On CPU that is the same moment (kernels run synchronously); on CUDA the
gate records an event on the current stream per layer and a thread of its own waits for each
event in order, then hands the layer on (``on_ready``: the prefill side posts its WRITEs). So
WRITEs of layer i overlap the computation of layers i+1.. and never read unwritten KV.
``drain`` (from ``wait_for_save``, after the forward) waits until every recorded layer was
handed on, so a step's layers are all posted before the next step's work replaces them.

Threading model: ``record`` and ``drain`` on the forward thread; ``on_ready`` runs on the
gate's own thread (``kvpush-layer-gate``), which takes no lock of its own. That thread first makes
the KV's GPU its current device (``device``): a TP rank on another GPU than 0 opens no context on
GPU 0 with its first CUDA call there.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class LayerGate:
    def __init__(self, on_ready: Callable[[int], None], device: Any = None) -> None:
        import torch

        self._torch = torch
        self._on_ready = on_ready
        self._device = device  # the KV's GPU (None: the thread's default)
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvpush-layer-gate", daemon=True)
        self._thread.start()

    def record(self, layer: int) -> None:
        """Layer ``layer``'s KV writes are enqueued on the current stream: hand it on once run."""
        if self._closed:
            return
        event = self._torch.cuda.Event()
        event.record()
        self._queue.put((layer, event))

    def drain(self) -> None:
        """Return once every recorded layer was handed on."""
        if not self._closed:
            self._queue.join()

    def _run(self) -> None:
        if self._device is not None:
            try:
                self._torch.cuda.set_device(self._device)
            except Exception:  # layers are still handed on, from the thread's default device
                log.exception("kvpush: the layer gate could not use the KV's GPU")
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                layer, event = item
                event.synchronize()
                self._on_ready(layer)
            except Exception:  # a layer that could not be posted fails its transfer's deadline
                log.exception("kvpush: handing on a computed layer failed")
            finally:
                self._queue.task_done()

    def close(self) -> None:
        """Hand on what is recorded, then end the thread; later calls do nothing."""
        if self._closed:
            return
        self._queue.join()
        self._closed = True
        self._queue.put(None)
        self._thread.join(5.0)
