"""The routing benchmark harness (issue 32): the 2P2D systems' commands, the reuse tables, the
gateway's routing decisions per point (``gateway_rows.routing_of`` on synthetic ``/dashboard/data``
rows) and the generated TTFT tables with ratios peer / kvpush-routed and the decisions."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import (
    add_arguments,
    chat_workload,
    gateway_rows,
    plan,
    results,
    routing_report,
    vllm_client,
)
from kvpush.benchmarks.serve.loadgen import LoadPoint, RequestResult
from kvpush.benchmarks.serve.systems import (
    KVPUSH_SYSTEMS,
    BenchContext,
    KvpushLeastLoaded,
    KvpushPush,
    KvpushRouted,
)
from kvpush.services.settings import ConfigError
from tests.http_server import serving

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- systems -----------------------------------------------------------------------------------


def test_routed_system_is_2p2d_push_with_the_default_threshold(tmp_path: Path) -> None:
    system = KVPUSH_SYSTEMS["kvpush-routed"]()
    assert isinstance(system, KvpushRouted)
    argv = system.argv(BenchContext(tmp_path, "m", tmp_path), 8123)
    assert (_value(argv, "--prefill"), _value(argv, "--decode")) == ("2", "2")
    assert _value(argv, "--mode") == "push" and _value(argv, "--port") == "8123"
    assert "--local-threshold" not in argv  # 0 would mean never LOCAL: routed keeps its default
    assert system.environment() == {"KVPUSH_ROUTING": "routed"}
    assert system.request_extra == {}  # a kvpush_mode would override the policy
    assert system.transfer == "none"  # local answers are the policy's choice, not a failure


def test_routing_systems_are_2p1d_on_one_gpu(tmp_path: Path) -> None:
    ctx = BenchContext(tmp_path, "m", tmp_path, device="cuda", gpu=3, gpu_memory_utilization=0.25)
    for name in ("kvpush-routed", "kvpush-least-loaded"):
        argv = KVPUSH_SYSTEMS[name]().argv(ctx, 8126)
        assert (_value(argv, "--prefill"), _value(argv, "--decode")) == ("2", "1"), name
        assert _value(argv, "--gpus") == "3" and _value(argv, "--gpu-memory-utilization") == "0.25"
        assert "--decode-gpu-memory-utilization" not in argv  # D: the engines' share
    ctx.decode_gpu_memory_utilization = 0.4  # --decode-gpu-memory-utilization: D's own
    argv = KVPUSH_SYSTEMS["kvpush-routed"]().argv(ctx, 8126)
    assert _value(argv, "--decode-gpu-memory-utilization") == "0.4"


def test_the_one_pair_row_is_routed_1p1d_on_either_device(tmp_path: Path) -> None:
    for device in ("cpu", "cuda"):
        ctx = BenchContext(tmp_path, "m", tmp_path, device=device, gpu_memory_utilization=0.28)
        system = KVPUSH_SYSTEMS["kvpush-routed-1p1d"]()
        argv = system.argv(ctx, 8127)
        assert "--prefill" not in argv and "--decode" not in argv  # kvpush up's 1P1D
        assert system.environment() == {"KVPUSH_ROUTING": "routed"}
        assert "--local-threshold" not in argv and system.request_extra == {}
    plan.from_args(_args("--systems", "kvpush-routed-1p1d,vllm-serve", "--device", "cpu"))


def test_least_loaded_system_keeps_the_old_threshold(tmp_path: Path) -> None:
    system = KVPUSH_SYSTEMS["kvpush-least-loaded"]()
    assert isinstance(system, KvpushLeastLoaded)
    argv = system.argv(BenchContext(tmp_path, "m", tmp_path), 8124)
    assert (_value(argv, "--prefill"), _value(argv, "--decode")) == ("2", "2")
    assert _value(argv, "--local-threshold") == "256"
    assert system.environment() == {"KVPUSH_ROUTING": "least-loaded"}
    assert system.request_extra == {}


def test_existing_systems_still_move_every_prompt(tmp_path: Path) -> None:
    system = KvpushPush()
    argv = system.argv(BenchContext(tmp_path, "m", tmp_path), 8125)
    assert _value(argv, "--local-threshold") == "0"
    assert "--prefill" not in argv and "--decode" not in argv
    assert system.environment() == {} and system.request_extra == {"kvpush_mode": "push"}
    assert system.transfer == "gateway"


def test_kvpush_up_s_gateway_reads_the_routing_variable() -> None:
    """The policy reaches the gateway through KVPUSH_ROUTING (kvpush up passes its environment)."""
    from kvpush.services.gateway.config import SETTINGS

    (row,) = [s for s in SETTINGS if s.name == "routing"]
    assert row.variable == "KVPUSH_ROUTING"
    assert {"routed", "least-loaded"} <= set(row.choices or ())


# -- plan and vLLM's client: the reuse tables --------------------------------------------------


def test_reuse_tables_are_vllm_client_tables_and_the_systems_are_known() -> None:
    argv = ["--tables", "reuse50:1024,reuse90:1024", "--client", "vllm", "--device", "cpu"]
    argv += ["--systems", "kvpush-routed,kvpush-least-loaded,vllm-serve,vllm-push"]
    the_plan = plan.from_args(_args(*argv, "--qps", "", "--concurrency", "1,4"))
    assert [t.key for t in the_plan.tables] == ["reuse50:1024", "reuse90:1024"]
    assert the_plan.systems[:2] == ("kvpush-routed", "kvpush-least-loaded")
    with pytest.raises(ConfigError, match="no reuse90 dataset"):
        plan.from_args(_args("--tables", "reuse90:1024", "--client", "kvpush", "--device", "cpu"))
    with pytest.raises(ConfigError, match="unknown system"):
        plan.from_args(_args("--systems", "kvpush-routd", "--device", "cpu"))


@pytest.mark.parametrize(
    ("dataset", "prefix", "suffix"), [("reuse50", "512", "512"), ("reuse90", "922", "102")]
)
def test_reuse_points_use_vllm_s_prefix_repetition_dataset(
    tmp_path: Path, dataset: str, prefix: str, suffix: str
) -> None:
    point = LoadPoint(dataset, 1024, 24, concurrency=4, output_len=16, seed=3)
    argv = vllm_client.bench_argv("http://h:1", "m", tmp_path, point, tmp_path / "r.json", "p-")
    assert _value(argv, "--dataset-name") == "prefix_repetition"
    assert _value(argv, "--prefix-repetition-prefix-len") == prefix
    assert _value(argv, "--prefix-repetition-suffix-len") == suffix
    assert _value(argv, "--prefix-repetition-num-prefixes") == "4"
    assert _value(argv, "--prefix-repetition-output-len") == "16"
    assert _value(argv, "--num-prompts") == "24" and _value(argv, "--max-concurrency") == "4"
    assert not any(flag.startswith("--random-") for flag in argv)


@pytest.mark.parametrize(("requests", "groups"), [(24, 4), (21, 3), (22, 2), (23, 1), (1, 1)])
def test_reuse_groups_divide_the_requests(requests: int, groups: int) -> None:
    """vLLM makes requests // prefixes prompts per prefix: a divisor drops none."""
    assert vllm_client.reuse_prefixes(requests) == groups


def test_vllm_s_own_parser_accepts_a_reuse_point(tmp_path: Path) -> None:
    """The flags exist in the installed vLLM's `vllm bench serve` (0.26's copy has them too)."""
    point = LoadPoint("reuse90", 1024, 20, concurrency=1, output_len=16, seed=3)
    argv = vllm_client.bench_argv("http://h:1", "m", tmp_path, point, tmp_path / "r.json", "p-")
    code = (
        "import sys\n"
        "from vllm.benchmarks.serve import add_cli_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(sys.argv[1:])\n"
        "print(a.dataset_name, a.prefix_repetition_prefix_len, a.prefix_repetition_num_prefixes)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-3:] == ["prefix_repetition", "922", "4"]
    gpu_copy = ROOT / ".gpu" / "site" / "vllm" / "benchmarks" / "datasets" / "datasets.py"
    if gpu_copy.exists():
        text = gpu_copy.read_text()
        for flag in argv:
            if flag.startswith("--prefix-repetition-"):
                assert f'"{flag}"' in text, flag


# -- the multi-turn chat workload ---------------------------------------------------------------


def _words(text: str) -> int:
    return len(text.split())


def test_chat_turns_resend_their_conversation_after_one_system_prompt() -> None:
    prompts = chat_workload.conversations(1024, 10, seed=5, count_tokens=_words)
    assert len(prompts) == 10  # three conversations of four turns, cut to ten requests
    system = prompts[0][: prompts[0].index("User:")]
    assert all(p.startswith(system) for p in prompts)
    conversations = 3
    turns = chat_workload.TURNS
    for i, prompt in enumerate(prompts[conversations:], start=conversations):
        previous = prompts[i - conversations]  # the same conversation's previous turn
        assert prompt.startswith(previous + "Assistant:\n")
        assert prompt.count("User:") == i // conversations + 1 <= turns
    assert len({p[len(system) :].split("\n")[1] for p in prompts[:conversations]}) == 3
    last = chat_workload.conversations(1024, 4, seed=5, count_tokens=_words)[-1]
    assert 1024 * 0.95 <= _words(last) <= 1024 * 1.05  # each part cut to its length, + roles
    assert chat_workload.conversations(1024, 10, 5, _words) == prompts  # seeded


def test_a_chat_point_is_vllm_s_custom_dataset_read_in_its_order(tmp_path: Path) -> None:
    point = LoadPoint("chat", 512, 8, concurrency=2, output_len=16, seed=3)
    path = chat_workload.write_dataset(tmp_path / "c.jsonl", 512, 8, 16, 3, _words)
    argv = vllm_client.bench_argv(
        "http://h:1", "m", tmp_path, point, tmp_path / "r.json", "p-", chat_path=path
    )
    assert _value(argv, "--dataset-name") == "custom"
    assert _value(argv, "--dataset-path") == str(path)
    assert _value(argv, "--custom-output-len") == "16"
    assert {"--disable-shuffle", "--skip-chat-template"} <= set(argv)
    with pytest.raises(ValueError, match="dataset file"):
        vllm_client.bench_argv("http://h:1", "m", tmp_path, point, tmp_path / "r.json", "p-")
    code = (
        "import sys\n"
        "from vllm.benchmarks.datasets.datasets import CustomDataset\n"
        "d = CustomDataset(dataset_path=sys.argv[1], disable_shuffle=True, random_seed=1)\n"
        "for r in d.sample(None, 8, skip_chat_template=True): print(repr(r.prompt))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    expected = chat_workload.conversations(512, 8, 3, _words)
    assert out.stdout.splitlines()[-8:] == [repr(p) for p in expected]
    gpu_copy = ROOT / ".gpu" / "site" / "vllm" / "benchmarks" / "datasets" / "datasets.py"
    if gpu_copy.exists():
        text = gpu_copy.read_text()
        for flag in ("--dataset-path", "--disable-shuffle", "--skip-chat-template"):
            assert f'"{flag}"' in text, flag
    the_plan = plan.from_args(
        _args("--tables", "chat:1024", "--client", "vllm", "--device", "cpu", "--qps", "")
    )
    assert [t.key for t in the_plan.tables] == ["chat:1024"]


# -- the gateway's routing decisions of a point ---------------------------------------------------


def _row(
    rid: str,
    mode: str,
    reason: str,
    ttft: float | None,
    estimate: float | None = None,
    decode_hit: int | None = None,
    decode_id: str = "d0",
    status: str = "ok",
    seq: int = 0,
) -> dict[str, Any]:
    """A ``/dashboard/data`` row as the gateway writes it (route keys included)."""
    return {
        "seq": seq,
        "request_id": rid,
        "mode": mode,
        "status": status,
        "prompt_tokens": 1024,
        "ttft_ms": ttft,
        "kv": "received" if mode == "push" else "",
        "parts_ms": None,
        "route_reason": reason,
        "route_choice": f"{mode} p0>{decode_id}" if estimate is not None else "",
        "estimate_ms": estimate,
        "prefix_tokens": None if decode_hit is None else [0, decode_hit],
        "decode_id": decode_id,
        "prefill_id": "" if mode == "local" else "p0",
    }


def test_routing_of_groups_by_mode_and_reason() -> None:
    rows = [
        _row("a", "push", "cost", 100.0, 90.0, 0, "d0"),
        _row("b", "push", "cost", 300.0, 110.0, 512, "d1"),
        _row("c", "push", "cost", None, 100.0, 896, "d1", status="decode failed"),
        _row("d", "local", "cost", 40.0, 35.5, 896, "d0"),
        _row("e", "local", "cold", 250.1234, None, None, "d1"),
    ]
    found = gateway_rows.routing_of(rows)
    assert found == {
        "decode": {"d0": 2, "d1": 3},
        "groups": {
            "local/cold": {
                "count": 1,
                "decode_prefix_p50": None,
                "estimate_p50_ms": None,
                "ttft_p50_ms": 250.123,
            },
            "local/cost": {
                "count": 1,
                "decode_prefix_p50": 896.0,
                "estimate_p50_ms": 35.5,
                "ttft_p50_ms": 40.0,
            },
            "push/cost": {  # the failed request counts, but has no TTFT
                "count": 3,
                "decode_prefix_p50": 512.0,
                "estimate_p50_ms": 100.0,
                "ttft_p50_ms": 200.0,
            },
        },
        "requests": 5,
    }
    text = json.dumps(found, sort_keys=False)  # stored as built: keys already sorted
    assert text == json.dumps(found, sort_keys=True)
    assert gateway_rows.routing_of([]) is None


def test_routing_of_takes_an_older_gateway_s_missing_keys_as_absent() -> None:
    old = {"request_id": "a", "mode": "push", "status": "ok", "ttft_ms": 12.0, "parts_ms": None}
    found = gateway_rows.routing_of([old, {**old, "request_id": "b", "mode": "local"}])
    assert found is not None and found["decode"] == {}
    assert set(found["groups"]) == {"push/-", "local/-"}
    assert found["groups"]["push/-"] == {
        "count": 1,
        "decode_prefix_p50": None,
        "estimate_p50_ms": None,
        "ttft_p50_ms": 12.0,
    }


async def test_point_rows_reads_the_point_s_rows_once_they_are_there() -> None:
    rows = [_row("other-1", "push", "cost", 5.0, seq=1), _row("p-1", "push", "cost", 7.0, seq=2)]
    ring = {"instance": "g1", "capacity": 200}

    async def data(_request: web.Request) -> web.Response:
        payload = {"parts": [], "counters": {}, "requests": list(rows), "ring": ring}
        return web.json_response(payload)

    app = web.Application()
    app.router.add_get("/dashboard/data", data)
    async with serving(app) as url:
        mark = await gateway_rows.ring_mark(url)
        assert mark == gateway_rows.RingMark("g1", 2)
        ours = gateway_rows.ours_of("vllm", gateway_rows.RingMark("g1", 1), [])  # after seq 1

        async def late() -> None:  # the gateway adds a row after the request's last chunk
            await asyncio.sleep(0.2)
            rows.insert(0, _row("cmpl-x", "local", "cost", 3.0, decode_id="d1", seq=3))

        adding = asyncio.create_task(late())
        found = await gateway_rows.point_rows(url, ours, expected=2)
        await adding
        assert [r["request_id"] for r in found or []] == ["cmpl-x", "p-1"]
        extras = await gateway_rows.point_extras(url, ours, 2)
        assert extras["breakdown"] is None  # no row has its parts
        assert extras["routing"]["groups"].keys() == {"local/cost", "push/cost"}
        assert "of" not in extras["routing"]  # every row of the point was read
        answered = [RequestResult(0, 1024, request_id="p-1", ttft_s=0.1)]
        by_id = await gateway_rows.point_rows(url, gateway_rows.ours_of("kvpush", mark, answered))
        assert [r["request_id"] for r in by_id or []] == ["p-1"]  # kvpush's client: its ids

        # the gateway restarted mid-point: its seq counts from 1 again, under a new instance
        ring["instance"] = "g2"
        rows[:] = [_row("cmpl-y", "push", "cost", 4.0, seq=1)]
        after_restart = gateway_rows.ours_of("vllm", mark, [])
        found = await gateway_rows.point_rows(url, after_restart, expected=1)
        assert [r["request_id"] for r in found or []] == ["cmpl-y"]
        extras = await gateway_rows.point_extras(url, after_restart, 3)
        assert extras["routing"]["requests"] == 1 and extras["routing"]["of"] == 3
        assert results.ring_partial(extras["routing"]) == "1 of 3"
        assert results.ring_partial(extras["breakdown"]) == ""
    assert await gateway_rows.point_rows(url, ours) is None  # the gateway is gone
    assert await gateway_rows.ring_mark(url) is None  # unread: no row is taken for the point
    nothing = gateway_rows.ours_of("vllm", None, [])
    assert not nothing("g1", {"seq": 5})
    assert await gateway_rows.point_extras(url, ours, 2) == {"breakdown": None, "routing": None}


async def test_an_older_gateway_s_ring_is_told_by_seq_alone() -> None:
    rows = [_row("a", "push", "cost", 5.0, seq=4), _row("b", "push", "cost", 5.0, seq=3)]

    async def data(_request: web.Request) -> web.Response:  # no "ring": before it was sent
        return web.json_response({"parts": [], "counters": {}, "requests": rows})

    app = web.Application()
    app.router.add_get("/dashboard/data", data)
    async with serving(app) as url:
        assert await gateway_rows.ring_mark(url) == gateway_rows.RingMark("", 4)
        ours = gateway_rows.ours_of("vllm", gateway_rows.RingMark("", 3), [])
        assert [r["request_id"] for r in await gateway_rows.point_rows(url, ours) or []] == ["a"]


def test_every_kvpush_system_reports_its_gateway_s_rows() -> None:
    """run.py reads the gateway's rows for every ``KvpushSystem`` point, whatever its transfer
    check (tests/integration/test_bench_serve.py reads a real point's): every kvpush system is
    one, and no vLLM peer (whose proxy has no such rows) is."""
    from kvpush.benchmarks.serve.run import system_classes
    from kvpush.benchmarks.serve.systems import KvpushSystem

    fronted = {n for n, c in system_classes().items() if issubclass(c, KvpushSystem)}
    assert {"kvpush-routed", "kvpush-least-loaded", "kvpush-push"} <= fronted
    assert not any(n.startswith("vllm") for n in fronted)


# -- the generated tables ----------------------------------------------------------------------


def _point(system: str, dataset: str, conc: int, p50: float, p99: float) -> results.Point:
    row = {
        "system": system,
        "dataset": dataset,
        "input_len": 1024,
        "point": f"c={conc}",
        "label": f"c={conc}",
        "load_kind": "concurrency",
        "load": float(conc),
        "requests": 20,
        "completed": 20,
        "errors": 0,
        "ttft_ms": {"mean": p50, "p50": p50, "p99": p99},
        "tpot_ms": {"mean": p99 / 10, "p50": p99 / 10, "p99": p99 / 5},
    }
    return results.point(row)


def _document() -> results.Document:
    points = []
    for dataset, slow in (("reuse50", 2.0), ("reuse90", 5.0)):
        for conc in (1, 4):
            points.append(_point("kvpush-routed", dataset, conc, 10.0 * conc, 20.0 * conc))
            points.append(_point("kvpush-least-loaded", dataset, conc, slow * 10 * conc, 99.0))
            points.append(_point("vllm-serve", dataset, conc, 5.0 * conc, 40.0 * conc))
    ok = {"ok": True, "runs": []}
    systems = {n: ok for n in ("kvpush-routed", "kvpush-least-loaded", "vllm-serve")}
    systems["vllm-push"] = {"ok": False, "error": "did not start\nmore"}
    return results.Document(meta={"device": "cpu", "repeats": 1}, systems=systems, points=points)


def test_routing_tables_show_p50_p99_tpot_and_ratios_over_routed() -> None:
    text = routing_report.body(_document())
    assert "### 90% reuse, 1024-token prompts (`reuse90:1024`)" in text
    assert "| c=4 | kvpush-routed | 40.0 | 80.0 | 8.00 | 20/0 |" in text  # TPOT mean 80 / 10
    # least-loaded at 90% reuse, c=1: P50 50 ms over routed's 10 ms; P99 99 over 20
    assert "| c=1 | kvpush-least-loaded | 5.00 | 4.95 |" in text
    assert "| c=4 | vllm-serve | 0.50 | 2.00 |" in text  # 20/40, 160/80
    assert "| c=1 | kvpush-least-loaded | 2.00 | 4.95 |" in text  # the 50% table
    assert "- vllm-push: did not start" in text
    assert text.index("reuse50:1024") < text.index("reuse90:1024")


def test_a_table_of_the_one_pair_row_alone_has_ratios_over_it() -> None:
    document = _document()
    for found in document.points:
        if found.system == "kvpush-routed":
            found.system = "kvpush-routed-1p1d"
    text = routing_report.body(document)
    assert "Ratios peer / kvpush-routed-1p1d of the medians" in text
    assert "| c=4 | vllm-serve | 0.50 | 2.00 |" in text


def test_a_table_without_routed_rows_has_no_ratios() -> None:
    document = _document()
    document.points = [p for p in document.points if p.system != "kvpush-routed"]
    text = routing_report.body(document)
    assert "Ratios" not in text and "| c=1 | vllm-serve | 5.00 | 40.0 | 4.00 | 20/0 |" in text


def test_write_doc_then_check_and_a_hand_edit_fails(tmp_path: Path) -> None:
    data, doc = tmp_path / "results.json", tmp_path / "results.md"
    data.write_text(results.dumps(_document()))
    doc.write_text("# Routing\n\nProse.\n")
    assert routing_report.write_doc(doc, data) is True
    assert routing_report.main([str(data), str(doc), "--check"]) == 0
    doc.write_text(doc.read_text().replace("| 40.0 | 80.0 |", "| 39.0 | 80.0 |"))
    with pytest.raises(docgen.DocOutOfDate):
        routing_report.write_doc(doc, data, check=True)
    assert routing_report.main([str(data), str(doc), "--check"]) == 1


def _routing(push: int, local: int, ttft: float, estimate: float) -> dict[str, Any]:
    group = {"decode_prefix_p50": 896.0, "estimate_p50_ms": estimate, "ttft_p50_ms": ttft}
    return {
        "decode": {"d0": push, "d1": local},
        "groups": {
            "local/cost": {"count": local, **group, "ttft_p50_ms": ttft / 2},
            "push/cost": {"count": push, **group},
        },
        "requests": push + local,
    }


def _with_routing() -> results.Document:
    document = _document()
    repeats = []
    for p in document.points:
        if p.system == "kvpush-routed":
            p.routing = _routing(16, 4, 400.0, 100.0)
            again = results.point({**msgspec.to_builtins(p), "repeat": 1})
            again.routing = _routing(14, 6, 500.0, 120.0)
            repeats.append(again)
    document.points += repeats
    return document


def test_decisions_table_sums_counts_and_takes_medians_over_repeats() -> None:
    text = routing_report.body(_with_routing())
    assert text.count("Decisions of the kvpush systems") == 2  # one per table
    tail = text[text.index("`reuse90:1024`") :]
    decisions = tail[tail.index("Decisions") :]
    row = (
        "| c=4 | kvpush-routed | local/cost: 10, push/cost: 30 | local/cost 225 vs 110, "
        "push/cost 450 vs 110 | d0 30, d1 10 |"
    )
    assert row in decisions
    assert "| c=1 | kvpush-routed |" in decisions and "vllm-serve" not in decisions
    assert tail.index("Ratios") < tail.index("Decisions")  # below the table's ratios


def test_decisions_table_only_when_a_point_recorded_routing() -> None:
    assert "Decisions" not in routing_report.body(_document())
    document = _with_routing()
    document.points = [p for p in document.points if p.dataset == "reuse50" or not p.routing]
    text = routing_report.body(document)
    assert text.count("Decisions") == 1 and text.index("Decisions") < text.index("reuse90:1024")


def test_a_document_without_routing_loads_and_one_with_it_round_trips() -> None:
    plain = json.loads(results.dumps(_document()))
    for p in plain["points"]:
        del p["routing"]  # as written before routing was recorded
    assert all(p.routing is None for p in results.loads(json.dumps(plain)).points)
    document = _with_routing()
    again = results.loads(results.dumps(document))
    assert [p.routing for p in again.points] == [p.routing for p in document.points]


def test_the_card_a_gpu_run_ran_on_is_named_in_both_reports() -> None:
    from kvpush.benchmarks.serve import report

    document = _document()
    document.meta = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB", "repeats": 1}
    assert "Run: device cuda, gpu NVIDIA H100 80GB HBM3, 81559 MiB, repeats 1." in (
        routing_report.body(document)
    )
    assert ", on NVIDIA H100 80GB HBM3, 81559 MiB, model " in report.render(document)
    document.meta = {"device": "cpu", "repeats": 1}  # a CPU run (or one from before): no card
    run_line = next(line for line in report.render(document).splitlines() if "Run of" in line)
    assert ", on " not in run_line and ", nixl ?, model ?" in run_line
