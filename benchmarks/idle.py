"""kvpush bench idle: what a decode engine costs while it waits for KV, in every executor mode.

For each mode a fresh decode engine (tiny model, kvpush connector, its own process tree) takes
one request whose KV is to be pushed by a prefill worker that does not exist, so it waits until
the transfer's deadline. The CPU time of the engine's whole process tree (the engine process and
every process vLLM started for it, from /proc) is sampled over ``--window-s`` seconds twice:
with nothing to do (idle) and while the request waits (waiting). Target: <= 5 % of one core
while waiting.

Modes: ``uni`` (vLLM's uniproc executor: scheduler and model in the engine process, what
``kvpush up`` runs at TP 1), ``mp`` (vLLM's multiprocess executor: a worker process per rank;
TP 1 and TP 2), and ``core-proc`` (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: vLLM's own engine-core
process stepping by itself, driven by a plain ``LLMEngine``; kvpush does not use it).

``--report FILE [--doc DOC] [--check]`` prints (or writes into DOC's generated section) the table
of a results file instead of running.

Threading model: the parent samples /proc from its main thread; each engine runs in a spawned
child (its own threads, see ``EngineHost``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen

MODES = (("uni", 1), ("mp", 1), ("mp", 2), ("core-proc", 1))
TARGET_PCT = 5.0
DECODE_ID = "idle-d"
REPORT_COMMAND = "kvpush bench idle --report docs/benchmarks/idle.json --doc docs/connector.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window-s", type=float, default=10.0, help="sampling window (10)")
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--report", metavar="FILE", help="run nothing: the table of FILE")
    parser.add_argument("--doc", metavar="DOC", help="with --report: write it into DOC")
    parser.add_argument("--check", action="store_true", help="with --report --doc: only compare")


def _tree_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and every live descendant, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def _kv(deadline_s: float) -> dict[str, Any]:
    return {
        "kvpush": {
            "transfer_id": f"idle-{uuid.uuid4().hex[:12]}",
            "prefill_id": "nobody",
            "decode_id": DECODE_ID,
            "mode": "push",
            "deadline_ms": int((time.time() + deadline_s) * 1000),
            # a side channel nobody answers: once the deadline passes D probes it, finds the
            # prefill gone and computes the prompt itself (an unnamed peer would hold the blocks)
            "prefill_address": "tcp://127.0.0.1:9",
        }
    }


def _child(conn: Any, mode: str, tp: int, model: str, nats_url: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from kvpush.connector import VLLM_CONNECTOR_CLASS, VLLM_CONNECTOR_MODULE

    kv_config = {
        "kv_connector": VLLM_CONNECTOR_CLASS,
        "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "worker_id": DECODE_ID,
            "role": "decode",
            "nats_url": nats_url,
        },
    }
    cores = sorted(os.sched_getaffinity(0))
    if mode == "core-proc":
        _core_proc_child(conn, model, kv_config, cores)
        return
    from kvpush.schemas.messages import SamplingSpec
    from kvpush.services.workers.engine import EngineConfig, EngineHost

    host = EngineHost(
        EngineConfig(
            model_dir=model,
            kv_transfer_config=kv_config,
            cpu_cores=cores,
            tensor_parallel_size=tp,
            executor=mode,
        )
    )
    host.start()
    conn.send("ready")
    while (command := conn.recv()) is not None:
        handle = host.submit(
            f"r-{uuid.uuid4().hex[:8]}",
            list(range(10, 310)),
            SamplingSpec(max_tokens=1, temperature=0.0),
            _kv(command),
        )
        conn.send("submitted")
        handle.result(command + 120)
        conn.send("done")
    host.stop()


def _core_proc_child(conn: Any, model: str, kv_config: dict[str, Any], cores: list[int]) -> None:
    import threading

    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
    )
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=4096,
            block_size=128,
            kv_transfer_config=KVTransferConfig(**kv_config),
        ),
        enable_multiprocessing=True,
    )
    conn.send("ready")
    while (command := conn.recv()) is not None:
        params = SamplingParams(
            max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": _kv(command)}
        )
        engine.add_request(
            f"r-{uuid.uuid4().hex[:8]}", {"prompt_token_ids": list(range(10, 310))}, params
        )
        conn.send("submitted")
        done = threading.Event()

        def drive(done: threading.Event = done) -> None:
            while engine.has_unfinished_requests():
                engine.step()
            done.set()

        threading.Thread(target=drive, daemon=True).start()
        done.wait(command + 120)
        conn.send("done")
    engine.engine_core.shutdown()


def measure(mode: str, tp: int, window_s: float, model: str, nats_url: str, log: str) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, mode, tp, model, nats_url, log))
    proc.start()
    try:
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError(f"{mode} TP {tp}: the engine did not start (see {log})")
        time.sleep(2.0)  # let start-up work (spinning queues, warm-up) settle
        idle = _sample(proc.pid, window_s)
        parent.send(window_s + 4.0)  # the transfer's deadline: past the sampling window
        assert parent.recv() == "submitted"
        time.sleep(1.0)
        waiting = _sample(proc.pid, window_s)
        if not parent.poll(window_s + 180) or parent.recv() != "done":
            raise RuntimeError(f"{mode} TP {tp}: the request did not end (see {log})")
        parent.send(None)
        proc.join(120)
    finally:
        if proc.is_alive():
            proc.kill()
    return {"mode": mode, "tp": tp, "window_s": window_s, "idle_pct": idle, "waiting_pct": waiting}


def _sample(pid: int, window_s: float) -> float:
    start, started = _tree_cpu_s(pid), time.monotonic()
    time.sleep(window_s)
    return round(100.0 * (_tree_cpu_s(pid) - start) / (time.monotonic() - started), 1)


def table(results: dict[str, Any]) -> str:
    rows = [
        (
            r["mode"],
            r["tp"],
            f"{r['idle_pct']:.1f}",
            f"{r['waiting_pct']:.1f}",
            "met" if r["waiting_pct"] <= TARGET_PCT else "missed",
        )
        for r in results["modes"]
    ]
    head = ("executor mode", "TP", "idle, % of a core", "waiting for KV, % of a core", "<= 5 %")
    meta = results["meta"]
    note = (
        f"One decode engine per mode (tiny model, 2-core CPU box), CPU of its whole process tree"
        f" over {results['modes'][0]['window_s']:.0f} s; run {meta['stamp']} at {meta['revision']}."
    )
    return docgen.table(head, rows) + "\n\n" + note


def main(args: argparse.Namespace) -> int:
    if args.report:
        return docgen.publish_report(args, table, "idle", REPORT_COMMAND)
    from kvpush.services import models
    from kvpush.services.natsd import EmbeddedNats

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    model = str(models.build_model(models.TINY, models.default_model_cache_dir() / "kvpush-tiny"))
    log_dir = Path.home() / ".cache" / "kvpush" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = str(log_dir / "bench-idle.log")  # vLLM's output of every engine
    print(f"kvpush bench idle: engine logs in {log}", flush=True)
    results: dict[str, Any] = {"meta": {"stamp": docgen.stamp(), "revision": docgen.revision()}}
    results["modes"] = []
    nats = EmbeddedNats()
    nats.start()
    try:
        for mode, tp in MODES:
            print(f"kvpush bench idle: {mode} TP {tp} ...", flush=True)
            row = measure(mode, tp, args.window_s, model, nats.url, log)
            print(f"  idle {row['idle_pct']} %, waiting {row['waiting_pct']} %", flush=True)
            results["modes"].append(row)
    finally:
        nats.stop()
    text = json.dumps(results, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(table(results))
    return 0
