"""GPU probe: does a NIXL region registered across two CUDA allocations take a WRITE over UCX
``cuda_ipc``? (The H200 soak of 2026-12-06 saw every transfer fail with ``cuMemcpyDtoDAsync
... invalid argument`` while its engines' per-layer KV tensors may have sat side by side.)

Run on the GPU host (tests/gpu/h200.sh ipc): a target process allocates ``LAYERS`` tensors of
``MIB`` MiB the way vLLM allocates a KV cache (one ``torch.zeros`` per layer), reports whether
they touch, and registers them as ``registration_descs`` makes the rows (``kvpush`` as it is
now), or merged into one span (``--merged``: the rule before 2026-12-06); a writer process
WRITEs 1 MiB of 7s into the last tensor; the target checks the bytes. One JSON line per mode.

Threading model: two processes (spawn), each single-threaded, a Pipe between them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import numpy as np

LAYERS, MIB, PAYLOAD = 4, 256, 1 << 20  # vLLM: 32 tensors of 256 MiB for an 8 GiB cache
GET_ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def _agent(name: str) -> Any:
    from kvpush.connector.agent import AgentConfig, NixlAgent

    return NixlAgent(AgentConfig(name=name, ucx_env=GET_ZCOPY))


def target(conn: Any, merged: bool, device: str) -> None:
    import torch

    from kvpush.connector.layout import MemType, pool_layout, registration_descs

    mem = MemType.VRAM if device == "cuda" else MemType.DRAM
    if device == "cuda":
        torch.cuda.set_device(0)
    tensors = [torch.zeros(MIB << 20, dtype=torch.int8, device=device) for _ in range(LAYERS)]
    ptrs = [t.data_ptr() for t in tensors]
    touching = [ptrs[i + 1] == ptrs[i] + (MIB << 20) for i in range(LAYERS - 1)]
    layout = pool_layout([[t.view(-1, 1 << 20)] for t in tensors])
    rows = registration_descs(layout)
    if merged:  # the old rule: touching spans merge, whichever tensors they are
        spans: list[list[int]] = []
        for ptr in sorted(ptrs):
            if spans and ptr == spans[-1][1]:
                spans[-1][1] = ptr + (MIB << 20)
            else:
                spans.append([ptr, ptr + (MIB << 20)])
        rows = np.array([[a, b - a, 0] for a, b in spans], dtype=np.uint64)
    agent = _agent(f"target-{merged}")
    agent.register_rows(rows, mem)
    conn.send((agent.metadata(), ptrs, touching, len(rows)))
    done = conn.recv()
    if device == "cuda":
        torch.cuda.synchronize()
    into = next((i + 1 for i, t in enumerate(touching) if t), len(ptrs) - 1)
    landed = bool((tensors[into][:PAYLOAD] == 7).all().item())
    conn.send(landed)
    del done


def writer(conn: Any, device: str) -> None:
    import torch

    from kvpush.connector.agent import XferStatus
    from kvpush.connector.layout import MemType

    mem = MemType.VRAM if device == "cuda" else MemType.DRAM
    if device == "cuda":
        torch.cuda.set_device(0)
    source = torch.full((PAYLOAD,), 7, dtype=torch.int8, device=device)
    agent = _agent("writer")
    agent.register_rows(np.array([[source.data_ptr(), PAYLOAD, 0]], np.uint64), mem)
    metadata, ptrs, touching, _ = conn.recv()
    peer = agent.add_peer(metadata)
    local = np.array([[source.data_ptr(), PAYLOAD, 0]], np.uint64)
    into = next((i + 1 for i, t in enumerate(touching) if t), len(ptrs) - 1)
    remote = np.array([[ptrs[into], PAYLOAD, 0]], np.uint64)
    outcome = "DONE"
    try:
        handle, status = agent.post_rows("WRITE", local, remote, peer, mem, PAYLOAD)
        deadline = time.monotonic() + 20
        while status is XferStatus.PROC and time.monotonic() < deadline:
            status, why = agent.status(handle)
        outcome = status.name if status is not XferStatus.ERR else f"ERR {why}"
        agent.release(handle)
    except Exception as exc:  # the probe reports it, whatever it is
        outcome = f"failed: {exc}"
    conn.send(outcome)


def probe(merged: bool, device: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    owner = ctx.Process(target=target, args=(a, merged, device))
    sender = ctx.Process(target=writer, args=(c, device))
    owner.start()
    metadata, ptrs, touching, regions = b.recv()
    sender.start()
    d.send((metadata, ptrs, touching, regions))
    outcome = d.recv()
    b.send("done")
    landed = b.recv()
    for p in (owner, sender):
        p.join(30)
    return {"merged": merged, "touching": touching, "regions": regions, "write": outcome,
            "landed": landed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merged", action="store_true", help="also the old one-span rule")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the plumbing only)")
    args = parser.parse_args()
    for merged in (False, True) if args.merged else (False,):
        print(json.dumps(probe(merged, args.device)), flush=True)


if __name__ == "__main__":
    main()
