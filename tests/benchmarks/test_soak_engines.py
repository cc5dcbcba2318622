"""The soak's engines per device: the settings a device gives, the workers' command lines, the
prompts' sizes, the time budget, a killed worker's whole process group, and the report's
device and model (its markdown and its section of the docs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shlex
import signal
import subprocess
from pathlib import Path

import msgspec
import pytest

from kvpush.benchmarks import docgen, soak
from kvpush.benchmarks.soak import engines, report
from kvpush.benchmarks.soak.accounting import PathCount
from kvpush.benchmarks.soak.run import FINAL_RESERVE_S, load_until
from kvpush.benchmarks.soak.stack import SoakStack, group_gone, group_members
from kvpush.schemas.messages import WorkerRole
from kvpush.services.workers import config as worker_config
from tests.benchmarks.test_soak_report import settings, synthetic

NATS = "nats://127.0.0.1:4222"
GPU_RUN = ["--device", "cuda", "--model", "llama-8b", "--prompt-tokens", "2048"]


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_cpu_defaults_stay_the_tiny_model_slowed_on_one_core_each() -> None:
    s = soak.settings_from_args(parse())
    assert (s.device, s.model, s.prompt_tokens, s.time_budget_s) == ("cpu", "tiny", None, None)
    assert s.layer_delay_ms == 100 and s.start_timeout_s == 240
    assert (s.gpu, s.gpu_memory_utilization, s.kv_cache_gib) == (None, None, None)


def test_cuda_runs_the_8b_shape_unslowed_with_time_to_capture_graphs() -> None:
    s = soak.settings_from_args(parse(*GPU_RUN, "--time-budget", "555"))
    assert (s.device, s.model, s.prompt_tokens, s.time_budget_s) == ("cuda", "llama-8b", 2048, 555)
    assert s.layer_delay_ms == 0 and s.start_timeout_s == engines.START_TIMEOUT_S["cuda"] > 240
    assert (s.gpu, s.gpu_memory_utilization, s.kv_cache_gib) == (0, 0.25, 8)
    given = soak.settings_from_args(parse(*GPU_RUN, "--layer-delay-ms", "5", "--kv-cache-gib", "6"))
    assert given.layer_delay_ms == 5 and given.kv_cache_gib == 6  # a flag wins over the device


def test_a_prompt_of_no_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt-tokens"):
        soak.settings_from_args(parse("--prompt-tokens", "0"))


def three_workers(engines_: engines.Engines, layer_delay_ms: float) -> SoakStack:
    return SoakStack(
        engines_, Path("/tmp/soak-logs"), prefill=2, decode=1, layer_delay_ms=layer_delay_ms,
        max_inflight=8, start_timeout_s=540,
    )  # fmt: skip


def worker_config_of(stack: SoakStack, worker_id: str) -> worker_config.WorkerConfig:
    """What the worker makes of its command line, through its own parser."""
    argv, _ = stack.worker_argv(worker_id, NATS)
    at = argv.index("kvpush.services.cli") + 1
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(argv[at + 1 :])
    return worker_config.config_from_args(WorkerRole(argv[at]), args, env={})


def test_cuda_workers_share_one_gpu_with_the_cuda_defaults_and_a_fixed_kv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the --engine-arg flags are vLLM's to parse (tests/integration/test_vllm_in_child.py): not
    # here, where importing vLLM would break the rule that engines live in child processes
    monkeypatch.setattr(worker_config, "parse_engine_args", lambda flags, **_: {})
    gpu = engines.Engines("cuda", tmp_path, "kvpush-llama-8b-shape", load_format="dummy", gpu=1)
    stack = three_workers(gpu, layer_delay_ms=0)
    for worker in stack.workers:
        _, env = stack.worker_argv(worker, NATS)
        assert "KVPUSH_FAULT_LAYER_DELAY_MS" not in env  # P not slowed
        engine = worker_config_of(stack, worker).engine_config()
        assert (engine.device, engine.gpu, engine.gpu_memory_utilization) == ("cuda", 1, 0.25)
        assert engine.load_format == "dummy" and engine.dtype == "bfloat16"
        assert engine.engine_core == "process" and not engine.enforce_eager  # CUDA graphs
        assert engine.engine_args == (f"--kv-cache-memory-bytes={8 << 30}",)
        assert "fault_layer_delay_ms" not in engine.kv_transfer_config["kv_connector_extra_config"]
    # three engines (KV, weights, activations and graphs, GiB) and two dead KV caches still
    # mapped by a peer leave a restarted engine the memory it needs free at its start
    assert 3 * (8 + 15 + 4) < 139 and 139 - 2 * (8 + 15 + 4) - 2 * 8 >= 0.25 * 139
    decode = stack.worker_argv("soak-d0", NATS)[0]
    assert decode[decode.index("--side-channel-port") + 1] == str(stack.ports["soak-d0"])


def test_cpu_workers_keep_their_command_line(tmp_path: Path) -> None:
    cpu = engines.Engines("cpu", tmp_path, "kvpush-tiny")
    stack = three_workers(cpu, layer_delay_ms=100.0)
    argv, env = stack.worker_argv("soak-p1", NATS)
    assert argv[1:] == [
        "-m", "kvpush.services.cli", "prefill", "--id", "soak-p1", "--nats-url", NATS,
        "--model", str(tmp_path), "--cpus", stack.cores["soak-p1"],
    ]  # fmt: skip
    assert env == {"KVPUSH_FAULT_LAYER_DELAY_MS": "100.0"}
    engine = worker_config_of(stack, "soak-d0").engine_config()
    assert engine.device == "cpu" and engine.enforce_eager and engine.engine_core == "thread"


def test_cores_one_each_on_cpu_and_an_even_share_each_on_cuda() -> None:
    workers = ["soak-p0", "soak-p1", "soak-d0"]
    assert engines.core_sets([0, 1], workers, "cpu") == {
        "soak-p0": "0", "soak-p1": "1", "soak-d0": "0",
    }  # fmt: skip
    assert engines.core_sets(list(range(16)), workers, "cuda") == {
        "soak-p0": "0,1,2,3,4", "soak-p1": "5,6,7,8,9", "soak-d0": "10,11,12,13,14",
    }  # fmt: skip
    assert engines.core_sets([0, 1], workers, "cuda") == {
        "soak-p0": "0", "soak-p1": "1", "soak-d0": "0",
    }  # fmt: skip


def test_on_cuda_the_first_engine_starts_alone_then_the_others_at_once(tmp_path: Path) -> None:
    workers = ["soak-p0", "soak-p1", "soak-d0"]
    gpu = engines.Engines("cuda", tmp_path, "m")
    assert gpu.start_batches(workers) == [["soak-p0"], ["soak-p1", "soak-d0"]]
    assert engines.Engines("cpu", tmp_path, "m").start_batches(workers) == [workers]
    assert engines.Engines("cpu", tmp_path, "m").flags() == []


class WordTokens:
    """A fast tokenizer's shape: each word is ``len(word) // 2`` tokens (at least one)."""

    def __call__(self, text: str, **_: object) -> dict[str, list[tuple[int, int]]]:
        spans, at = [], 0
        for word in text.split(" "):
            pieces = max(1, len(word) // 2)
            step = len(word) / pieces
            spans += [(at + round(i * step), at + round((i + 1) * step)) for i in range(pieces)]
            at += len(word) + 1
        return {"offset_mapping": spans}


@pytest.mark.parametrize("tokens", [3, 50, 2048])
def test_a_sized_prompt_is_whole_words_of_at_most_that_many_tokens(tokens: int) -> None:
    words = ("a", "bbbb", "cccccc", "dd")  # 1, 2, 3 and 1 token(s)
    prompt = engines.sized_prompt(random.Random(7), words, tokens, WordTokens())
    count = len(WordTokens()(prompt)["offset_mapping"])
    assert tokens - 3 < count <= tokens  # the last word that did not fit: 3 tokens at most
    assert set(prompt.split(" ")) <= set(words)
    assert prompt == engines.sized_prompt(random.Random(7), words, tokens, WordTokens())


def test_the_load_ends_in_time_for_the_budget_or_after_its_minutes() -> None:
    eight = settings(minutes=8)
    assert load_until(eight, begun=0, started=150) == 150 + 480
    budget = msgspec.structs.replace(eight, time_budget_s=555)
    assert load_until(budget, begun=0, started=150) == 555 - FINAL_RESERVE_S
    assert load_until(budget, begun=0, started=600) == 600  # no load left at all
    assert load_until(msgspec.structs.replace(budget, minutes=1), 0, 150) == 210


def test_a_killed_group_is_gone_only_once_every_member_exited() -> None:
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True
    )  # the worker and its engine-core process, in one group
    try:
        members = group_members(leader.pid)
        for _ in range(100):  # the shell's children may not have forked yet
            if len(members) >= 3:
                break
            asyncio.run(asyncio.sleep(0.05))
            members = group_members(leader.pid)
        assert leader.pid in members and len(members) >= 3
        assert not asyncio.run(group_gone(leader.pid, 0.0))
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    assert asyncio.run(group_gone(leader.pid, 10.0)) and group_members(leader.pid) == []


def test_group_members_read_proc_skipping_zombies_and_other_groups(tmp_path: Path) -> None:
    stats = {
        "10": "10 (python3) S 1 10 10",
        "11": "11 (VLLM::Engine (core) x) R 10 10 10",  # comm with spaces and parentheses
        "12": "12 (sleep) Z 10 10 10",  # dead, not yet reaped
        "13": "13 (bash) S 1 13 13",
    }
    for pid, stat in stats.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat)
    assert sorted(group_members(10, tmp_path)) == [10, 11]


def gpu_report() -> report.SoakReport:
    gpu = settings(
        device="cuda", model="llama-8b", prompt_tokens=2048, time_budget_s=555, gpu=0,
        gpu_memory_utilization=0.25, kv_cache_gib=8.0, layer_delay_ms=0, prefill=2, decode=1,
        start_timeout_s=540,
    )  # fmt: skip
    return synthetic(settings=gpu)


def test_the_report_carries_device_and_model_to_its_json_and_its_table(tmp_path: Path) -> None:
    path = tmp_path / "soak-h200.json"
    path.write_bytes(report.dump(gpu_report()))
    loaded = report.load(path)
    assert (loaded.settings.device, loaded.settings.model) == ("cuda", "llama-8b")
    table = report.markdown(loaded)
    assert "2 prefill + 1 decode workers (cuda: every engine on GPU 0, model llama-8b" in table
    assert "0.25 of the GPU's memory free and a 8 GiB KV cache" in table
    assert "prompts of about 2048 tokens" in table and "P not slowed" in table
    assert "time budget of 555 s" in table and "P sleeping" not in table
    cpu = report.markdown(synthetic(settings=settings(device="cpu", model="tiny")))
    assert "(cpu, model tiny, prompts of 8-40 words, 8 tokens out)" in cpu
    assert "P sleeping 100 ms per layer" in cpu
    card = "NVIDIA H100 80GB HBM3, 81559 MiB"  # the run's card, as nvidia-smi names it
    path.write_bytes(report.dump(msgspec.structs.replace(loaded, gpu_name=card)))
    assert f"every engine on GPU 0 ({card}), model" in report.markdown(report.load(path))
    old = report.markdown(synthetic())  # written before the device was kept: as it rendered
    assert "cpu" not in old and "cuda" not in old and "model" not in old


def test_the_cached_path_is_explained_only_where_a_report_has_one() -> None:
    cached = [PathCount("push/cached", 3, 1, 0, 0)]
    held = synthetic(paths=[*synthetic().paths, *cached], gateway_kv_outcomes={
        "push/received": 60, "pull/received": 30, "push/cached": 4,
    })  # fmt: skip
    assert report.failures(held) == []  # the gateway's count and the soak's agree
    assert "`cached`: D's own prefix cache held the prompt" in report.markdown(held)
    assert "`cached`" not in report.markdown(synthetic())


def test_a_gpu_report_goes_to_its_own_section_and_leaves_the_cpu_one(tmp_path: Path) -> None:
    assert report.section_of(gpu_report())[0] == report.GPU_SECTION != report.SECTION
    assert report.section_of(synthetic())[0] == report.SECTION
    doc = tmp_path / "reliability.md"
    docgen.update(doc, report.SECTION, "the CPU soak's table", report.REPORT_COMMAND)
    path = tmp_path / "soak-h200.json"
    path.write_bytes(report.dump(gpu_report()))
    assert soak.main(parse("--report", str(path), "--doc", str(doc))) == 0
    text = doc.read_text()
    assert docgen.section(text, report.SECTION) == "the CPU soak's table"
    assert docgen.section(text, report.GPU_SECTION) == report.markdown(gpu_report())
    assert report.GPU_REPORT_COMMAND in text
    assert soak.main(parse("--report", str(path), "--doc", str(doc), "--check")) == 0


def test_each_committed_gpu_soak_table_is_the_one_its_json_generates() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    runs = sorted(docs.glob(f"reliability-{report.GPU_SECTION}*.json"))
    if not runs:
        pytest.skip("no GPU soak committed yet (tests/gpu/h200.sh soak)")
    doc = (docs / "reliability.md").read_text()
    for json_path in runs:
        committed = report.load(json_path)
        name, command = report.section_of(committed, json_path)
        assert docgen.section(doc, name) == report.markdown(committed), json_path
        assert command in doc and report.failures(committed) == committed.failures


def test_every_gpu_run_gets_a_section_named_after_its_file() -> None:
    run = gpu_report()
    assert report.section_of(run, Path("docs/reliability-soak-h200.json")) == (
        report.GPU_SECTION,
        report.GPU_REPORT_COMMAND,
    )
    name, command = report.section_of(run, Path("docs/reliability-soak-h200-2.json"))
    assert name == "soak-h200-2" and "--report docs/reliability-soak-h200-2.json" in command
    assert report.section_of(run, Path("/tmp/out/soak-h200.json"))[0] == report.GPU_SECTION


def test_the_h200_soak_step_runs_2p1d_of_the_8b_shape_with_the_issues_faults() -> None:
    script = (Path(__file__).resolve().parents[1] / "gpu" / "h200.sh").read_text()
    step = script[script.index("\nsoak)") : script.index("\n    ;;", script.index("\nsoak)"))]
    command = step[
        step.index("cli bench soak") + len("cli bench soak") : step.index('> "$out/soak.log"')
    ]
    command = command.replace("\\\n", " ")
    command = re.sub(r'"\$\{\w+:-([^}]*)\}"', r"\1", command)  # ${MINUTES:-8} etc.: defaults
    command = command.replace("$((limit - 30))", "540").replace('"$out/', '"/tmp/out/')
    s = soak.settings_from_args(parse(*shlex.split(command)))
    assert (s.device, s.model, s.prefill, s.decode, s.minutes) == ("cuda", "llama-8b", 2, 1, 8)
    assert set(s.faults) == {"kill_prefill", "kill_decode", "stop_prefill", "stop_decode",
                             "restart_nats"} and s.fault_every_s == 60  # fmt: skip
    assert s.prompt_tokens == 2048 and s.layer_delay_ms == 0 and s.time_budget_s == 540
    blocks_per_prompt = -(-(s.prompt_tokens + s.max_tokens) // 128)
    cached_prompts = int(s.kv_cache_gib * engines.GIB / (128 * 128 * 1024 * blocks_per_prompt))
    assert s.prompts >= 3 * cached_prompts  # most push and pull requests move KV
    assert 'timeout "$limit"' in step and "limit=$((${LIMIT:-570} - SECONDS))" in step
