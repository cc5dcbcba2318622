"""The serving benchmark's pieces without engines: load generator, plan, transfer checks
(the summary and report are in ``test_bench_report``).

The load generator runs against a scripted SSE server that answers ``/v1/completions`` like
vLLM's OpenAI server (one SSE chunk per token, a usage chunk, ``[DONE]``) after known delays,
so what it measures is checked against what was scripted. The plan's seeds and the transfer
checks (on real gateway metrics text and synthetic proxy stats) run on synthetic data.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvpush.benchmarks.serve import (
    add_arguments,
    checks,
    loadgen,
    plan,
    systems,
)
from kvpush.benchmarks.serve.loadgen import RequestResult
from kvpush.services.gateway.metrics import GatewayMetrics
from kvpush.services.settings import ConfigError
from tests.http_server import serving, serving_completions

FIRST_DELAY_S = 0.05
GAP_S = 0.01
REPO = Path(__file__).resolve().parents[2]


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"][0] == 13:  # the scripted failure
        return web.json_response({"error": {"message": "boom"}}, status=500)
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert body["stream_options"]["continuous_usage_stats"] is False
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_DELAY_S)
    n = body["max_tokens"]
    for i in range(n):
        if i:
            await asyncio.sleep(GAP_S)
        chunk = {"id": f"cmpl-{body['prompt'][1]}", "choices": [{"text": f"t{i}"}]}
        if i == n - 1:
            chunk["choices"][0]["finish_reason"] = "length"
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage: dict[str, Any] = {"completion_tokens": n, "prompt_tokens": len(body["prompt"])}
    if "cached" in body:  # an extra field of the test: report it as D's cached tokens
        usage["prompt_tokens_details"] = {"cached_tokens": body["cached"]}
    final = {"id": "x", "choices": [], "usage": usage}
    await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async with serving_completions(completions) as base_url:
        yield base_url


# -- load generator ----------------------------------------------------------------------------


async def test_a_concurrency_point_measures_what_the_server_scripted(server: str) -> None:
    point = loadgen.LoadPoint("random", 4, 6, concurrency=2, output_len=5)
    prompts = [[10 + (i == 3) * 3, i, 0, 0] for i in range(6)]  # request 3 fails (token 13)
    done: list[int] = []
    found, wall = await loadgen.run_point(
        server, "m", point, prompts, progress=lambda: done.append(1)
    )
    assert len(done) == 6
    summary_ = loadgen.summarize(found, wall)
    assert summary_["completed"] == 5 and summary_["errors"] == 1
    assert summary_["error_samples"][0].startswith("HTTP 500")
    ok = [r for r in found if r.error is None]
    assert [r.request_id for r in ok] == [f"cmpl-{i}" for i in (0, 1, 2, 4, 5)]
    for r in ok:
        assert r.output_tokens == 5 and len(r.itl_s) == 4 and r.prompt_tokens == 4
        assert r.cached_tokens is None  # the server reported no prompt_tokens_details
        assert r.ttft_s is not None and r.ttft_s >= FIRST_DELAY_S
        assert all(gap >= GAP_S * 0.9 for gap in r.itl_s)
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s + 4 * GAP_S * 0.9
    assert summary_["ttft_ms"]["p50"] >= FIRST_DELAY_S * 1e3
    assert summary_["tpot_ms"]["mean"] >= GAP_S * 1e3 * 0.9
    assert summary_["request_throughput"] == pytest.approx(5 / wall, rel=1e-3)


async def test_extra_fields_reach_the_server_and_cached_tokens_are_recorded(server: str) -> None:
    point = loadgen.LoadPoint("random", 4, 2, concurrency=1, output_len=2)
    found, _ = await loadgen.run_point(
        server, "m", point, [[10, 0, 0, 0], [10, 1, 0, 0]], extra={"cached": 3}
    )
    assert [(r.error, r.prompt_tokens, r.cached_tokens) for r in found] == [(None, 4, 3)] * 2


async def test_a_poisson_point_sends_on_its_seeded_schedule(server: str) -> None:
    point = loadgen.LoadPoint("random", 4, 8, qps=40.0, output_len=2, seed=3)
    offsets = loadgen.arrival_offsets(point)
    assert offsets == loadgen.arrival_offsets(point) and offsets[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(offsets))
    found, _ = await loadgen.run_point(server, "m", point, [[10, i, 0, 0] for i in range(8)])
    for result, offset in zip(found, offsets, strict=True):
        assert result.error is None
        assert result.sent_at >= offset - 0.005  # never early; how late is the box's business


def test_prompts_are_exact_length_and_deterministic(tmp_path: Path) -> None:
    a = loadgen.make_prompts("random", 64, 3, 0, tmp_path, 1000)
    assert a == loadgen.make_prompts("random", 64, 3, 0, tmp_path, 1000)
    assert [len(p) for p in a] == [64, 64, 64] and a[0] != a[1]
    assert all(16 <= t < 1000 for p in a for t in p)
    with pytest.raises(ValueError, match="unknown dataset"):
        loadgen.make_prompts("poems", 64, 1, 0, tmp_path, 1000)


# -- plan: tables, points, seeds ---------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _seeds(the_plan: plan.Plan, capacity: float = 4.0) -> dict[tuple[str, str, int], int]:
    found = {}
    for repeat in range(the_plan.repeats):
        for table in the_plan.tables:
            rates = (
                plan.auto_rates(capacity)
                if the_plan.qps == "auto"
                else plan.fixed_rates(the_plan.qps)
            )
            for spec in plan.points(the_plan, table, rates, repeat):
                found[(table.key, spec.point_id, repeat)] = spec.seed
    return found


def test_seeds_do_not_depend_on_the_subset_of_systems_tables_or_points() -> None:
    full = plan.from_args(_args())
    assert [t.key for t in full.tables] == [
        "random:512",
        "random:1024",
        "random:2048",
        "sonnet:2048",
    ]
    assert full.repeats == 3 and full.systems[0] == "kvpush-push"
    small = plan.from_args(
        _args("--systems", "vllm-push", "--tables", "sonnet:2048", "--concurrency", "4")
    )
    every, some = _seeds(full), _seeds(small, capacity=9.0)  # another probe: same ids
    assert set(some) <= set(every) and len(some) == 3 * 6
    assert all(every[key] == seed for key, seed in some.items())
    assert len(set(every.values())) == len(every)  # every point and repeat its own prompts
    # stable across processes and Python versions (no salted hash()):
    assert plan.point_seed("random", 2048, "0.9x", 0) == 9059711255653992606


def test_tables_option_and_its_cross_product_form() -> None:
    crossed = plan.from_args(_args("--datasets", "random,sonnet", "--input-lens", "512,2048"))
    assert [t.key for t in crossed.tables] == [
        "random:512",
        "random:2048",
        "sonnet:512",
        "sonnet:2048",
    ]
    assert plan.from_args(_args("--input-lens", "1024")).tables == (plan.Table("random", 1024),)
    quick = plan.from_args(_args("--quick", "--repeats", "2"))
    assert quick.tables == (plan.Table("random", 512),) and quick.repeats == 2
    assert plan.from_args(_args("--quick")).repeats == 1
    for bad in (("--tables", "poems:512"), ("--tables", "random"), ("--repeats", "0")):
        with pytest.raises(ConfigError):
            plan.from_args(_args(*bad))
    with pytest.raises(ConfigError, match="not both"):
        plan.from_args(_args("--tables", "random:512", "--input-lens", "512"))


def test_repeats_rotate_the_system_order() -> None:
    the_plan = plan.from_args(_args("--systems", "kvpush-push,vllm-pull,aggregated"))
    assert [the_plan.system_order(r) for r in range(3)] == [
        ["kvpush-push", "vllm-pull", "aggregated"],
        ["vllm-pull", "aggregated", "kvpush-push"],
        ["aggregated", "kvpush-push", "vllm-pull"],
    ]


# -- transfer checks ---------------------------------------------------------------------------


def _gateway_text(routed: dict[str, int], outcomes: dict[tuple[str, str], int]) -> str:
    metrics = GatewayMetrics()
    for mode, n in routed.items():
        metrics.routed.labels(mode).inc(n)
    for (mode, outcome), n in outcomes.items():
        metrics.kv_outcomes.labels(mode, outcome).inc(n)
    return metrics.render().decode()


def test_gateway_check_reads_the_real_metrics_text() -> None:
    before = checks.gateway_counts(_gateway_text({"push": 2}, {("push", "received"): 2}))
    assert before == {"routed.push": 2.0, "outcome.push.received": 2.0}
    good = checks.gateway_counts(_gateway_text({"push": 12}, {("push", "received"): 12}))
    check = checks.gateway_check(before, good, completed=10, mode="push")
    assert check.applies and check.ok and check.checked == 10 and check.without_transfer == 0

    fallback = {("push", "received"): 9, ("push", "fallback"): 3}
    after = checks.gateway_counts(_gateway_text({"push": 12}, fallback))
    check = checks.gateway_check(before, after, completed=10, mode="push")
    assert not check.ok and check.without_transfer == 3 and "3 fallback" in check.detail

    local = checks.gateway_counts(
        _gateway_text({"push": 10, "local": 2}, {("push", "received"): 10})
    )
    check = checks.gateway_check(before, local, completed=10, mode="push")
    assert not check.ok and check.without_transfer == 2 and "local 2" in check.detail

    pulled = checks.gateway_counts(
        _gateway_text({"push": 2, "pull": 10}, {("push", "received"): 2, ("pull", "received"): 10})
    )
    assert not checks.gateway_check(before, pulled, completed=10, mode="push").ok
    assert checks.gateway_check(before, pulled, completed=10, mode="pull").ok  # its own mode
    short = checks.gateway_counts(_gateway_text({"push": 12}, {("push", "received"): 11}))
    check = checks.gateway_check(before, short, completed=10, mode="push")
    assert not check.ok and check.without_transfer == 1
    held = {("push", "received"): 11, ("push", "cached"): 1}  # D's prefix cache held one prompt
    cached = checks.gateway_counts(_gateway_text({"push": 12}, held))
    check = checks.gateway_check(before, cached, completed=10, mode="push")
    assert check.ok and check.without_transfer == 0
    assert check.detail == "received 9 + 1 cached at D/10"
    nothing = checks.gateway_check(before, before, completed=0, mode="push")
    assert not nothing.ok and "no request served" in nothing.detail  # 0/0 proves nothing


def _served(*cached: int | None, prompt: int = 512) -> list[RequestResult]:
    return [
        RequestResult(i, prompt, ttft_s=0.1, e2e_s=0.2, prompt_tokens=prompt, cached_tokens=c)
        for i, c in enumerate(cached)
    ]


def test_cached_tokens_rule_and_proxy_check() -> None:
    assert checks.cached_rule(512, 512) and not checks.cached_rule(512, 511)
    assert not checks.cached_rule(512, 384) and not checks.cached_rule(512, None)
    stats = {"requests": 5, "no_kv_params": 1, "prefill_failed": 0, "decode_failed": 0}
    after = {**stats, "requests": 8}
    check = checks.proxy_check(stats, after, _served(512, 512, 512))
    assert check.ok and check.checked == 3 and check.without_transfer == 0

    check = checks.proxy_check(stats, after, _served(512, 384, None))
    assert not check.ok and check.without_transfer == 2
    assert "1 with D's cached tokens below the prompt (min 384)" in check.detail
    assert "1 without prompt_tokens_details" in check.detail

    no_kv = {**after, "no_kv_params": 3}
    check = checks.proxy_check(stats, no_kv, _served(512, 512, 512))
    assert not check.ok and check.without_transfer == 2 and "2 P answers" in check.detail
    failed = [*_served(512), RequestResult(1, 512, error="HTTP 502")]
    assert checks.proxy_check({**stats, "requests": 6}, after, failed).checked == 1
    assert not checks.proxy_check(stats, stats, []).ok  # nothing served: nothing proven
    partial = {k: v for k, v in after.items() if k != "no_kv_params"}
    check = checks.proxy_check(stats, partial, _served(512, 512, 512))
    assert not check.ok and "without no_kv_params" in check.detail
    check = checks.proxy_check(stats, {**after, "requests": 7}, _served(512, 512, 512))
    assert not check.ok and "saw 2 of 3 requests" in check.detail


def test_the_proxy_reads_d_s_usage_whatever_client_sent_the_load() -> None:
    """D's usage found in the streamed bytes however they were cut (and in a JSON body), and
    the check from the proxy's counts when the client did not read the usage itself."""
    from kvpush.benchmarks.serve.proxy import UsageScanner

    stream = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": '
    stream += b'{"prompt_tokens": 512, "prompt_tokens_details": {"cached_tokens": 512}}}\n\n'
    stream += b"data: [DONE]\n\n"
    for cut in (1, 7, 50, len(stream)):
        scanner = UsageScanner()
        for start in range(0, len(stream), cut):
            scanner.feed(stream[start : start + cut])
        assert scanner.end() == {
            "prompt_tokens": 512,
            "prompt_tokens_details": {"cached_tokens": 512},
        }
    body = UsageScanner()
    body.feed(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}')
    assert body.end() == {"prompt_tokens": 3, "completion_tokens": 1}
    stats = {"requests": 0, "no_kv_params": 0, "prefill_failed": 0, "decode_failed": 0}
    stats |= {"d_loaded": 0, "d_computed": 0, "d_unverified": 0}
    served = [RequestResult(i, 512, ttft_s=0.1, e2e_s=0.2) for i in range(3)]  # no usage read
    after = {**stats, "requests": 3, "d_loaded": 3}
    check = checks.proxy_check(stats, after, served)
    assert check.ok and check.checked == 3 and check.without_transfer == 0, check
    check = checks.proxy_check(stats, {**after, "d_loaded": 1, "d_computed": 2}, served)
    assert not check.ok and "2 with D's cached tokens below the prompt" in check.detail
    check = checks.proxy_check(stats, {**after, "d_loaded": 2}, served)  # one answer uncounted
    assert not check.ok and "1 without prompt_tokens_details" in check.detail


async def test_probe_waits_for_the_gateways_outcomes_of_a_point() -> None:
    metrics = GatewayMetrics()

    async def render(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", render)
    async with serving(app) as base_url:
        probe = checks.PointProbe("gateway", base_url, "push")
        await probe.before()
        metrics.routed.labels("push").inc(2)
        metrics.kv_outcomes.labels("push", "received").inc()

        async def last_outcome() -> None:  # the gateway counts it after the last chunk
            await asyncio.sleep(0.2)
            metrics.kv_outcomes.labels("push", "received").inc()

        late = asyncio.create_task(last_outcome())
        check = await probe.after(_served(None, None))
        await late
        assert check.ok and check.checked == 2, check
        assert check.counts == {"outcome.push.received": 2.0, "routed.push": 2.0}
    unreachable = checks.PointProbe("proxy", base_url)  # the server is gone
    await unreachable.before()
    check = await unreachable.after(_served(512))
    assert check.applies and not check.ok and "snapshot before" in check.detail
    none = checks.PointProbe("none", "http://unused")
    await none.before()
    assert (await none.after([])).applies is False


# -- summary, verdicts and the generated document ---------------------------------------------


def test_on_cuda_every_system_runs_the_bench_s_gpu_settings(tmp_path: Path) -> None:
    """The systems' commands on a GPU host: bf16, the bench's load format and memory share
    (the aggregated engine gets a P's plus a D's), the GPU picked by CUDA_VISIBLE_DEVICES, no
    CPU pinning; vllm-pull-tuned asks UCX for its cuda_ipc GET lane."""
    from kvpush.benchmarks.serve import vllm_systems
    from kvpush.benchmarks.serve.systems import BenchContext, KvpushPush

    ctx = BenchContext(tmp_path, "m", tmp_path, device="cuda", gpu=1, load_format="dummy")
    spec = vllm_systems.ServerSpec("prefill", 0, 1234)
    argv = vllm_systems.serve_argv(ctx, spec, log_stats=False)
    for flag, value in (("--dtype", "bfloat16"), ("--load-format", "dummy")):
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    engine = vllm_systems.serve_argv(ctx, vllm_systems.ServerSpec("engine", 0), False)
    assert engine[engine.index("--gpu-memory-utilization") + 1] == "0.8"
    env = vllm_systems.serve_env(
        spec, executor="uni", fix_affinity=True, nixl_pthr_delay_us=1000, gpu=1
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert not {"VLLM_CPU_KVCACHE_SPACE", "KVPUSH_VLLM_CPUS", "OMP_NUM_THREADS"} & set(env)
    assert (
        vllm_systems.nixl_config("NixlConnector", "kv_producer", "e", "cuda")["kv_buffer_device"]
        == "cuda"
    )
    kvpush = KvpushPush().argv(ctx, 4321)
    assert kvpush[kvpush.index("--device") + 1] == "cuda" and "--gpus" in kvpush
    assert kvpush[kvpush.index("--load-format") + 1] == "dummy"
    cpu = BenchContext(tmp_path, "m", tmp_path)
    cpu_argv = vllm_systems.serve_argv(cpu, spec, False)
    assert cpu_argv[cpu_argv.index("--dtype") + 1] == "float32"
    assert "--gpu-memory-utilization" not in cpu_argv
    # CPU: kvpush's engine settings, eager; GPU: vLLM's own defaults (graphs, block size, batch)
    assert {"--enforce-eager", "--block-size", "--max-num-seqs", "--disable-log-stats"} <= set(
        cpu_argv
    )
    assert not {"--enforce-eager", "--block-size", "--max-num-seqs", "--disable-log-stats"} & set(
        argv
    )
    assert "--enforce-eager" in vllm_systems.serve_argv(ctx, spec, False, eager=True)
    assert "--max-num-seqs" not in kvpush and "--enforce-eager" not in kvpush
    assert "--max-num-seqs" in KvpushPush().argv(cpu, 4321)


def test_gpu_systems_run_on_default_flags_and_eager_rows_are_named_so() -> None:
    """On a GPU the default systems are kvpush's two modes, vLLM's P/D as shipped (pull with
    its cuda_ipc lane, push) and vllm-serve; any of them with --enforce-eager is NAME-eager."""
    from kvpush.benchmarks.serve import GPU_SYSTEMS, run

    assert plan.from_args(_args("--device", "cuda")).systems == GPU_SYSTEMS
    assert "vllm-serve" in GPU_SYSTEMS and not any(s.endswith("-eager") for s in GPU_SYSTEMS)
    classes = run.system_classes()
    for name in GPU_SYSTEMS:
        eager = classes[f"{name}-eager"]
        assert eager.name == f"{name}-eager" and eager.eager and not classes[name].eager
        assert issubclass(eager, classes[name])
    plan.from_args(_args("--device", "cuda", "--systems", "kvpush-push,vllm-serve-eager"))


def test_the_tuned_pull_is_a_gpu_system_and_default_only_there() -> None:
    assert "vllm-pull-tuned" not in plan.from_args(_args("--device", "cpu")).systems
    assert "vllm-pull-tuned" in plan.from_args(_args("--device", "cuda")).systems


def test_vllm_s_client_is_the_gpu_default_with_its_own_datasets(tmp_path: Path) -> None:
    """`vllm bench serve` sends the load on a GPU (kvpush's load generator on CPU); a point's
    command: the table's exact lengths (prefix: half shared), greedy, ignore_eos, the seed,
    the rate or the concurrency, the system's extra fields, named requests."""
    from kvpush.benchmarks.serve import vllm_client

    assert plan.from_args(_args("--device", "cuda")).client == "vllm"
    assert plan.from_args(_args("--device", "cpu")).client == "kvpush"
    with pytest.raises(ConfigError, match="no sonnet dataset"):
        plan.from_args(_args("--device", "cuda", "--tables", "sonnet:2048"))
    with pytest.raises(ConfigError, match="no prefix dataset"):
        plan.from_args(_args("--device", "cpu", "--tables", "prefix:2048"))
    point = loadgen.LoadPoint("prefix", 2048, 40, qps=4.0, output_len=64, seed=11)
    argv = vllm_client.bench_argv(
        "http://h:1", "m", tmp_path, point, tmp_path / "r.json", "p-", {"kvpush_mode": "push"}
    )

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert (value("--random-input-len"), value("--random-prefix-len")) == ("1024", "1024")
    assert (value("--request-rate"), value("--seed"), value("--num-prompts")) == ("4", "11", "40")
    assert value("--temperature") == "0" and "--ignore-eos" in argv
    assert json.loads(value("--extra-body")) == {"kvpush_mode": "push"}
    assert "--max-concurrency" not in argv and value("--request-id-prefix") == "p-"
    c1 = loadgen.LoadPoint("random", 2048, 8, concurrency=1, output_len=64)
    argv = vllm_client.bench_argv("http://h:1", "m", tmp_path, c1, tmp_path / "r.json", "p-")
    assert (value("--request-rate"), value("--max-concurrency")) == ("inf", "1")
    assert "--random-prefix-len" not in argv and "--extra-body" not in argv
    big = loadgen.LoadPoint("random", 2048, 8, concurrency=1, output_len=64, seed=2**63 + 5)
    argv = vllm_client.bench_argv("http://h:1", "m", tmp_path, big, tmp_path / "r.json", "p-")
    assert value("--seed") == "5"  # the points' 64-bit seeds, as numpy takes them (32 bits)


async def test_a_kvpush_system_reads_its_gateway_s_port_from_up_s_banner(tmp_path: Path) -> None:
    """``kvpush up --port 0`` binds the port itself; the bench reads it from the banner, past
    what earlier repeats wrote to the same log."""

    log = tmp_path / "kvpush-push.log"
    log.write_text("kvpush is up: http://127.0.0.1:1111/v1 (an earlier repeat's)\n")
    offset = log.stat().st_size
    script = (
        "import time; time.sleep(0.3); "
        "print('kvpush is up: http://127.0.0.1:4567/v1 (model m, mode push). Try:', flush=True); "
        "time.sleep(30)"
    )
    process = systems.Process("kvpush-push", [sys.executable, "-c", script], log).start()
    try:
        assert await systems.wait_banner(process, offset, 20.0) == "http://127.0.0.1:4567"
    finally:
        process.signal(9)
    assert "--port" in (
        argv := systems.KvpushPush().argv(systems.BenchContext(tmp_path, "m", tmp_path), 0)
    )
    assert argv[argv.index("--port") + 1] == "0"
    dead = systems.Process(
        "up",
        [sys.executable, "-c", "print('port in use'); raise SystemExit(1)"],
        tmp_path / "dead.log",
    ).start()
    with pytest.raises(systems.StartError, match=r"exited \(1\)[\s\S]*port in use"):
        await systems.wait_banner(dead, 0, 20.0)
