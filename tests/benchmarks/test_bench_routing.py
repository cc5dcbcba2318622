"""The routing benchmark harness (issue 32): the 2P2D systems' commands, the reuse tables and
the generated TTFT tables with ratios peer / kvpush-routed."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import (
    add_arguments,
    chat_workload,
    plan,
    results,
    routing_report,
    vllm_client,
)
from kvpush.benchmarks.serve.loadgen import LoadPoint
from kvpush.benchmarks.serve.systems import (
    KVPUSH_SYSTEMS,
    BenchContext,
    KvpushLeastLoaded,
    KvpushPush,
    KvpushRouted,
)
from kvpush.services.settings import ConfigError

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


def test_routing_tables_show_p50_p99_and_ratios_over_routed() -> None:
    text = routing_report.body(_document())
    assert "### 90% reuse, 1024-token prompts (`reuse90:1024`)" in text
    assert "| c=4 | kvpush-routed | 40.0 | 80.0 | 20/0 |" in text
    # least-loaded at 90% reuse, c=1: P50 50 ms over routed's 10 ms; P99 99 over 20
    assert "| c=1 | kvpush-least-loaded | 5.00 | 4.95 |" in text
    assert "| c=4 | vllm-serve | 0.50 | 2.00 |" in text  # 20/40, 160/80
    assert "| c=1 | kvpush-least-loaded | 2.00 | 4.95 |" in text  # the 50% table
    assert "- vllm-push: did not start" in text
    assert text.index("reuse50:1024") < text.index("reuse90:1024")


def test_a_table_without_routed_rows_has_no_ratios() -> None:
    document = _document()
    document.points = [p for p in document.points if p.system != "kvpush-routed"]
    text = routing_report.body(document)
    assert "Ratios" not in text and "| c=1 | vllm-serve | 5.00 | 40.0 | 20/0 |" in text


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
