"""The connector with vLLM's engine multiprocessing ON: scheduler half in the EngineCore process,
worker half in a separate worker process, each with its own bus connection.

The prefill engine here is a plain vLLM ``LLMEngine(enable_multiprocessing=True)`` in a child
(three processes: this child, EngineCore, worker); the decode engine is the session's in-process
EngineHost. A swap test proves the KV moved.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import DECODE_ID, connector_config
from tests.integration.engine_proc import P_CORES, EngineProc
from tests.integration.test_connector_vllm import BLOCK, prompt, reference, request

pytestmark = pytest.mark.engine
MP_PREFILL_ID = "p-mp"


def _child(conn: Any, model: str, nats_url: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.sched_setaffinity(0, set(P_CORES))
    os.environ.update(
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(P_CORES[0]),
    )
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    config = KVTransferConfig(**connector_config("prefill", MP_PREFILL_ID, nats_url))
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=4096,
            block_size=BLOCK,
            kv_transfer_config=config,
            seed=0,
        ),
        enable_multiprocessing=True,
    )
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        rid, ids, kv = command
        params = SamplingParams(
            max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": kv}
        )
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        conn.send(tokens)
    engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def mp_prefill(
    tiny_model: Path,
    nats_server: EmbeddedNats,
    engine_logs: Path,
    pd_engines: tuple[EngineProc, EngineProc],
) -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_child,
        daemon=False,
        args=(child, str(tiny_model), nats_server.url, str(engine_logs / "P-mp.log")),
    )
    proc.start()
    try:
        assert parent.poll(240), "multiprocessing prefill engine did not start"
        assert parent.recv() == "ready"
        yield parent
        parent.send(None)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_push_with_prefill_engine_multiprocessing_on_is_token_exact(
    mp_prefill: Any, pd_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    decode = pd_engines[1]
    before = decode.free_blocks()
    a = prompt(rng, 2 * BLOCK + 33)
    b = [*prompt(rng, len(a) - 1), a[-1]]
    expected = reference(decode, a)
    assert expected != reference(decode, b)
    tid = f"tx-mp-{uuid.uuid4().hex[:12]}"
    kv = {
        "kvpush": {
            "transfer_id": tid,
            "prefill_id": MP_PREFILL_ID,
            "decode_id": DECODE_ID,
            "mode": "push",
        }
    }
    decode.submit([request(f"d-{tid}", b, kv=kv, salt=tid)])
    mp_prefill.send((f"p-{tid}", a, kv))
    assert mp_prefill.poll(60)
    assert len(mp_prefill.recv()) == 1
    (d_out,) = decode.collect([f"d-{tid}"])
    assert d_out["token_ids"] == expected
    assert d_out["kv_landed_ns"] > 0, d_out
    assert decode.free_blocks() == before
