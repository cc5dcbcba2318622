"""The worker half's per-step hand-over of computed layers to the prefill side.

vLLM replays a batch of one-token queries as one whole CUDA graph (its FULL graphs), and the
attention layers' ``save_kv_layer`` calls are not part of a replay. P computes such a step for a
prompt its prefix cache holds but for the last token: on the H100 soak of 2026-12-06, 15 pull
requests whose P prefill took 12-110 ms never got their KvReady and hung until the gateway's
60 s timeout. ``wait_for_save`` now hands over the layers of a forward that ran no hook and did
not fail. The test drives a ``WorkerHalf`` (it imports vLLM: in a child interpreter, one for
every case) with the recording transport and bus of ``test_connector_sides``.
"""

from __future__ import annotations

from typing import Any

from kvpush.connector.params import ConnectorSettings, PrefillWork
from kvpush.connector.vllm.outgoing import OutgoingState
from kvpush.schemas.messages import KvReady, TransferMode, WorkerRole
from tests.unit.test_connector_sides import (
    LAYERS,
    TID,
    Recorder,
    announcement,
    params,
    prefill_side,
)


def half_with_prefill(rec: Recorder) -> Any:
    from kvpush.connector.vllm.worker import WorkerHalf

    settings = ConnectorSettings(worker_id="p0", role=WorkerRole.PREFILL)
    half = WorkerHalf(settings, "model", "bfloat16", 4, engine_id="test-worker-half")
    half.prefill, _ = prefill_side(rec)
    half._layer_index = {f"layers.{i}.attn": i for i in range(LAYERS)}
    return half


def step(
    half: Any, mode: TransferMode, saved: range, completes: bool = True, forward_fails: bool = False
) -> None:
    """One engine step of request r0 (``completes``: it computes the prompt's last token);
    ``saved``: the layers whose ``save_kv_layer`` the forward ran; ``forward_fails``: it then
    raises (the caller calls ``wait_for_save``)."""
    from kvpush.connector.vllm.metadata import KVPushMetadata

    meta = KVPushMetadata()
    meta.prefill = [PrefillWork("r0", params(mode), [0, 1], 8, completes)]
    half.bind(meta)
    for layer in saved:
        half.save_kv_layer(f"layers.{layer}.attn")
    if forward_fails:
        raise RuntimeError("the forward failed")
    half.wait_for_save()


def test_every_layer_is_handed_over_once_after_the_forward_whatever_hooks_it_ran(
    in_child: bool,
) -> None:
    if not in_child:
        return
    for saved in (range(0), range(LAYERS)):  # a whole-graph replay runs none
        rec = Recorder()
        half = half_with_prefill(rec)
        step(half, TransferMode.PULL, saved)
        (ready,) = rec.messages(KvReady)
        assert ready.transfer_id == TID, saved
        assert half.prefill._by_tid[TID].state is OutgoingState.POSTED, saved

        rec = Recorder()
        half = half_with_prefill(rec)
        half.prefill.on_bus("", announcement())
        step(half, TransferMode.PUSH, saved)
        layers = [args[1] for name, args in rec.calls if name == "push_layers"]
        assert sorted(layers) == [[layer] for layer in range(LAYERS)], saved
        assert [name for name, _ in rec.calls][-1] == "finish", saved

    rec = Recorder()  # a forward that ran some hooks only is not a replay: nothing more goes
    half = half_with_prefill(rec)
    step(half, TransferMode.PULL, range(1))
    assert not rec.messages(KvReady)

    rec = Recorder()  # a step that does not complete the prompt hands nothing over
    half = half_with_prefill(rec)
    step(half, TransferMode.PULL, range(0), completes=False)
    assert not rec.messages(KvReady) and not rec.calls

    rec = Recorder()  # nor does a forward that raised (vLLM calls wait_for_save in a finally)
    half = half_with_prefill(rec)
    try:
        try:
            step(half, TransferMode.PULL, range(0), completes=True, forward_fails=True)
        finally:
            half.wait_for_save()
    except RuntimeError:
        pass
    assert not rec.messages(KvReady) and not rec.calls
