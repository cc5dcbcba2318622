"""The one settings mechanism (``kvpush.services.settings``) and the three tables built on it:
gateway, workers, ``kvpush up``."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import threading

import pytest

from kvpush.connector import switching
from kvpush.schemas.messages import WorkerRole
from kvpush.services import settings
from kvpush.services.gateway import config as gateway_config
from kvpush.services.settings import ConfigError, Setting
from kvpush.services.up_config import SETTINGS as UP_SETTINGS
from kvpush.services.up_config import UpConfig
from kvpush.services.workers import config as worker_config
from kvpush.services.workers import flags as worker_flags

TABLES = {
    "gateway": gateway_config.SETTINGS,
    "worker": worker_flags.SETTINGS,
    "up": UP_SETTINGS,
}
TABLE = (
    Setting("size", ("--size",), int, "how many"),
    Setting("wait_s", ("--wait-s", "--wait"), float, "how long", "KVPUSH_TEST_WAIT"),
    Setting("keys", ("--key",), str, "keys", repeat=True),
    Setting("secret_ms", ("--secret-ms",), float, "no flag", flag=False),
    Setting("cores", ("--cores",), lambda text: [int(c) for c in text.split(",")], "a list"),
)


def parse(table: tuple[Setting, ...], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, table)
    return parser.parse_args(argv)


def test_flag_beats_variable_and_absent_settings_are_left_to_the_defaults() -> None:
    env = {
        "KVPUSH_SIZE": "3",
        "KVPUSH_TEST_WAIT": "1.5",
        "KVPUSH_KEY": "a, b,",
        "KVPUSH_SECRET_MS": "",
    }
    assert settings.read(TABLE, parse(TABLE), env) == {"size": 3, "wait_s": 1.5, "keys": ["a", "b"]}
    given = parse(TABLE, "--size", "4", "--wait", "2", "--key", "x", "--key", "y")
    assert settings.read(TABLE, given, env) == {"size": 4, "wait_s": 2.0, "keys": ["x", "y"]}
    assert settings.read(TABLE, parse(TABLE), {}) == {}
    assert settings.read(TABLE, parse(TABLE), {"KVPUSH_SECRET_MS": "5"}) == {"secret_ms": 5.0}
    # a parser that is not idempotent (a string in, a list out) runs once, by flag or variable
    assert settings.read(TABLE, parse(TABLE, "--cores", "0,1"), {}) == {"cores": [0, 1]}
    assert settings.read(TABLE, parse(TABLE), {"KVPUSH_CORES": "2,3"}) == {"cores": [2, 3]}
    with pytest.raises(SystemExit):
        parse(TABLE, "--secret-ms", "5")  # environment only: no such flag


def test_a_bad_value_names_its_source() -> None:
    with pytest.raises(ConfigError, match="KVPUSH_SIZE: invalid value 'many'"):
        settings.read(TABLE, parse(TABLE), {"KVPUSH_SIZE": "many"})
    with pytest.raises(SystemExit) as exc:
        parse(TABLE, "--size", "many")  # argparse's one-line usage error
    assert exc.value.code == 2


def test_help_names_every_variable() -> None:
    for name, table in TABLES.items():
        parser = argparse.ArgumentParser()
        settings.add_arguments(parser, table)
        text = parser.format_help().replace("\n", " ")
        for row in table:
            if row.flag:
                assert f"[{row.variable}]" in " ".join(text.split()), (name, row.name)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_variable_names_are_consistent(name: str) -> None:
    table = TABLES[name]
    variables = [row.variable for row in table]
    assert len(set(variables)) == len(variables)
    for row in table:
        assert row.variable.startswith("KVPUSH_"), row
        if row.name.endswith("_s"):
            assert row.flags[0].endswith("-s") and row.variable.endswith("_S"), row


def test_a_variable_shared_by_two_services_means_the_same_there() -> None:
    parse_of: dict[str, object] = {}
    for table in TABLES.values():
        for row in table:
            assert parse_of.setdefault(row.variable, row.parse) is row.parse, row.variable


def test_worker_flags_parse_into_the_config(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--cpus", "0-2", "--nats", "nats://h:1", "--model", str(tmp_path)])
    env = {"KVPUSH_HEARTBEAT_S": "0.75"}
    config = worker_config.config_from_args(WorkerRole.PREFILL, args, env)
    assert config.cpu_cores == [0, 1, 2] and config.nats_url == "nats://h:1"
    assert config.heartbeat_s == 0.75 and config.lease_s == 1.5
    assert config.max_inflight == 1024 and config.max_num_seqs is None
    with pytest.raises(ConfigError, match="two heartbeats"):
        worker_config.config_from_args(
            WorkerRole.PREFILL, args, {"KVPUSH_HEARTBEAT_S": "1", "KVPUSH_LEASE_S": "1.5"}
        )


def test_worker_and_up_configs_raise_config_errors_not_exits(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--worker-id", "bad.id", "--model", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"bad\.id"):
        worker_config.config_from_args(WorkerRole.DECODE, args, {})
    up_args = parse(UP_SETTINGS, "--decode", "0")
    with pytest.raises(ConfigError, match="--decode"):
        UpConfig.from_args(up_args, {})
    assert UpConfig.from_args(parse(UP_SETTINGS), {"KVPUSH_UP_PREFILL": "2"}).prefill == 2


def test_tensor_parallel_flags_reach_the_engine_and_bad_ones_are_config_errors(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--cpus", "0,1", "--model", str(tmp_path)])
    engine = worker_config.config_from_args(WorkerRole.DECODE, args, {}).engine_config()
    assert (engine.tp, engine.backend) == (2, "mp")
    for bad, match in ((["--tp", "0"], "--tp"), (["--tp", "2", "--executor", "uni"], "mp")):
        args = parser.parse_args([*bad, "--model", str(tmp_path)])
        with pytest.raises(ConfigError, match=match):
            worker_config.config_from_args(WorkerRole.DECODE, args, {})
    with pytest.raises(ConfigError, match="--tp"):
        UpConfig.from_args(parse(UP_SETTINGS, "--tp", "0"), {})
    assert UpConfig.from_args(parse(UP_SETTINGS), {"KVPUSH_UP_TP": "2"}).tp == 2
    mixed = UpConfig.from_args(parse(UP_SETTINGS, "--prefill-tp", "2"), {})
    assert (mixed.tp_of("prefill"), mixed.tp_of("decode")) == (2, 1)
    with pytest.raises(ConfigError, match="one must divide the other"):
        UpConfig.from_args(parse(UP_SETTINGS, "--prefill-tp", "2", "--decode-tp", "3"), {})


def test_a_reasoning_parser_reaches_the_engine_and_kvpush_up_gives_it_to_gateway_and_workers(
    tmp_path,
) -> None:
    from kvpush.services.up import Stack
    from kvpush.services.workers.engine_config import engine_kwargs

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--reasoning-parser", "qwen3", "--model", str(tmp_path)])
    engine = worker_config.config_from_args(WorkerRole.DECODE, args, {}).engine_config()
    assert engine_kwargs(engine)["reasoning_parser"] == "qwen3"
    args = parser.parse_args(["--model", str(tmp_path)])
    engine = worker_config.config_from_args(WorkerRole.DECODE, args, {}).engine_config()
    assert "reasoning_parser" not in engine_kwargs(engine)  # vLLM's default: none

    flags = ("--reasoning-parser", "qwen3", "--vllm-arg=--enable-auto-tool-choice")
    stack = Stack(UpConfig.from_args(parse(UP_SETTINGS, *flags, "--log-dir", str(tmp_path)), {}))
    stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    stack._plan()
    for child in stack.workers:
        assert child.argv[child.argv.index("--reasoning-parser") + 1] == "qwen3"
    assert stack.gateway is not None
    gateway_argv = stack.gateway.argv
    assert "--vllm-arg=--enable-auto-tool-choice" in gateway_argv
    assert "--vllm-arg=--reasoning-parser=qwen3" in gateway_argv
    gateway_args = argparse.ArgumentParser()
    gateway_config.add_arguments(gateway_args)
    cli_args = gateway_args.parse_args(gateway_argv[gateway_argv.index("gateway") + 1 :])
    parsed = gateway_config.GatewayConfig.from_args(cli_args, {})
    assert parsed.vllm_args == ("--enable-auto-tool-choice", "--reasoning-parser=qwen3")


def test_engines_sharing_a_gpu_split_its_memory_with_decode_counted_twice() -> None:
    def shares(*flags: str) -> list[float]:
        config = UpConfig.from_args(parse(UP_SETTINGS, "--device", "cuda", *flags), {})
        return [config.gpu_share(n) for n in range(len(config.roles()))]

    assert shares() == [0.283, 0.567]  # 1P1D on GPU 0: D holds every answer's KV
    assert shares("--prefill", "2") == [0.212, 0.212, 0.425]
    assert shares("--gpus", "0,1") == [0.85, 0.85]  # an engine per GPU: each its 0.85
    assert shares("--gpu-memory-utilization", "0.3") == [0.3, 0.3]
    assert shares("--prefill", "2", "--gpu-memory-utilization", "0.25") == [0.25, 0.25, 0.25]
    given = ("--prefill", "2", "--gpu-memory-utilization", "0.25")
    assert shares(*given, "--decode-gpu-memory-utilization", "0.4") == [0.25, 0.25, 0.4]
    assert shares("--prefill-gpu-memory-utilization", "0.2") == [0.2, 0.65]  # D: what is left
    assert shares("--decode-gpu-memory-utilization", "0.6") == [0.25, 0.6]
    assert shares("--gpus", "0,0") == [0.283, 0.567]  # one GPU named twice: still one GPU
    with pytest.raises(ConfigError, match="nothing left"):
        shares("--decode-gpu-memory-utilization", "0.9")
    with pytest.raises(ConfigError, match=r"prefill 0.25 \+ prefill 0.25 \+ decode 0.5"):
        shares(*given, "--decode-gpu-memory-utilization", "0.5")


def test_gpu_plans_that_cannot_run_are_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(ConfigError, match="on CUDA is not supported yet"):
        UpConfig.from_args(parse(UP_SETTINGS, "--device", "cuda", "--tp", "2"), {})
    with pytest.raises(ConfigError, match="over the GPU"):
        UpConfig.from_args(
            parse(UP_SETTINGS, "--device", "cuda", "--gpu-memory-utilization", "0.6"), {}
        )
    assert UpConfig.from_args(
        parse(UP_SETTINGS, "--device", "cuda", "--gpus", "0,1"), {}
    ).gpu_list() == [0, 1]
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--device", "cuda", "--model", str(tmp_path)])
    with pytest.raises(ConfigError, match="on CUDA is not supported yet"):
        worker_config.config_from_args(WorkerRole.DECODE, args, {})


def test_the_layer_gate_does_nothing_once_closed() -> None:
    from kvpush.connector.vllm.gate import LayerGate

    handed: list[int] = []
    gate = LayerGate(handed.append)
    gate.close()
    gate.record(3)  # no CUDA needed: a closed gate records nothing
    gate.drain()
    gate.close()
    assert handed == []


def test_an_engine_on_cuda_reads_gpu_memory_over_cuda_ipc_unless_told_otherwise() -> None:
    """Pull mode's NIXL READ of GPU memory takes UCX's cuda_ipc lane only with GET zero-copy
    on (else TCP); a value the operator set stays."""
    from kvpush.services.workers.engine_config import EngineConfig, engine_env

    cuda = EngineConfig(model_dir="m", device="cuda", gpu=1)
    env = engine_env(cuda, {})
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in engine_env(
        cuda, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}
    )
    cpu = engine_env(EngineConfig(model_dir="m"), {})
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in cpu and cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_an_engine_on_cpu_skips_torch_inductors_isa_probe_unless_told_otherwise() -> None:
    """A TP rank's warm-up compiles with torch inductor, which probed each vector ISA in a child
    Python (60 s each when one hangs: a clean-clone run's TP start timed out that way): the
    engine trusts the ISA the CPU reports instead; an operator's own value stays; not on CUDA."""
    from kvpush.services.workers.engine_config import EngineConfig, engine_env

    assert engine_env(EngineConfig(model_dir="m"), {})["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    told = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}
    assert "TORCHINDUCTOR_VEC_ISA_OK" not in engine_env(EngineConfig(model_dir="m"), told)
    cuda = EngineConfig(model_dir="m", device="cuda", gpu=0)
    assert "TORCHINDUCTOR_VEC_ISA_OK" not in engine_env(cuda, {})


def test_p_and_d_on_one_gpu_set_the_same_vllm_environment() -> None:
    """vLLM keys its torch.compile cache with its environment variables too: P and D on one
    GPU (other cores, other roles) set the same ones, so the second engine loads what the
    first compiled (on the H200 D compiled again when each had its own core list, 22 s). On
    CPU each engine's core lists pin its ranks (the CPU backend reads them)."""
    from kvpush.services.workers.engine_config import EngineConfig, engine_env

    def engine(role: str, cores: list[int], device: str = "cuda", tp: int = 1) -> EngineConfig:
        transfer = {"kv_connector": "KVPushConnector", "kv_role": role}
        return EngineConfig(
            model_dir="m",
            device=device,
            gpu=0,
            cpu_cores=cores,
            kv_transfer_config=transfer,
            tensor_parallel_size=tp,
        )

    prefill, decode = engine("kv_producer", [0, 1, 2, 3]), engine("kv_consumer", [4, 5, 6, 7])
    assert engine_env(prefill, {}) == engine_env(decode, {})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(prefill, {})
    cpu = engine_env(engine("kv_consumer", [4, 5, 6, 7], device="cpu", tp=2), {})
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"


def test_engines_run_as_vllm_serve_on_cuda_and_in_a_thread_on_cpu_unless_told(tmp_path) -> None:
    """CUDA: an engine-core process (kvpush's scheduler and worker extension in it), graphs,
    vLLM's async scheduling; CPU: the engine on a worker thread, eager, no async scheduling.
    --engine-core and --enforce-eager (bare: on) override, and kvpush up passes them on."""
    from kvpush.connector import VLLM_SCHEDULER, VLLM_WORKER_EXTENSION
    from kvpush.services.workers.engine_config import engine_env, engine_kwargs

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)

    def engine(*flags: str) -> tuple[dict, dict]:
        args = parser.parse_args(["--model", str(tmp_path), *flags])
        cfg = worker_config.config_from_args(WorkerRole.DECODE, args, {}).engine_config()
        return engine_kwargs(cfg), engine_env(cfg, {})

    kwargs, env = engine("--device", "cuda")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and not kwargs["enforce_eager"]
    assert "async_scheduling" not in kwargs  # vLLM's own default
    assert "max_num_seqs" not in kwargs  # ... and vLLM's batch size for the GPU
    assert (kwargs["scheduler_cls"], kwargs["worker_extension_cls"]) == (
        VLLM_SCHEDULER,
        VLLM_WORKER_EXTENSION,
    )
    args = parser.parse_args(["--model", str(tmp_path), "--device", "cuda"])
    prefill = worker_config.config_from_args(WorkerRole.PREFILL, args, {}).engine_config()
    # P's forward waits for the layer hand-off: async scheduling held each first token back
    assert engine_kwargs(prefill)["async_scheduling"] is False
    kwargs, env = engine("--device", "cpu")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and kwargs["enforce_eager"]
    assert kwargs["async_scheduling"] is False and "scheduler_cls" not in kwargs
    assert kwargs["max_num_seqs"] == 64
    kwargs, env = engine("--device", "cuda", "--engine-core", "thread", "--enforce-eager")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and kwargs["enforce_eager"]
    from kvpush.services.up import Stack

    flags = ("--engine-core", "process", "--enforce-eager", "off", "--log-dir", str(tmp_path))
    stack = Stack(UpConfig.from_args(parse(UP_SETTINGS, *flags), {}))
    stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    stack._plan()
    for child in stack.workers:
        assert child.argv[child.argv.index("--engine-core") + 1] == "process"
        assert child.argv[child.argv.index("--enforce-eager") + 1] == "off"


def test_kvpush_up_says_what_each_starting_engine_is_doing(tmp_path) -> None:
    """The 'still starting' lines name each worker's phase from the last step its log names
    (vLLM's own lines: weights, compiling or loading compiled graphs, CUDA graph capture)."""
    from kvpush.services.up_child import Child

    log = tmp_path / "prefill-0.log"
    child = Child("prefill-0", ["true"], log, gpu=0)
    assert child.phase() == "waiting for its GPU"  # not started: another engine has the GPU
    child.start()
    assert child.proc is not None and child.proc.wait(10) == 0
    log.write_text("engine: importing vllm\n")
    assert child.phase() == "importing vLLM"
    with log.open("a") as out:
        out.write("engine: waiting for its GPU (another engine is measuring its memory)\n")
    assert child.phase() == "waiting for its GPU"
    with log.open("a") as out:
        out.write("[model_runner.py:284] Loading model from scratch...\n")
        out.write("[backends.py:393] Compiling a graph for compile range (1, 8192) takes 9 s\n")
    assert child.phase().startswith("compiling")
    with log.open("a") as out:
        out.write("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  40%|####\n")
    assert child.phase() == "capturing CUDA graphs"


def test_a_gpu_s_engines_start_at_once_when_each_remembers_its_kv_size(
    tmp_path, monkeypatch
) -> None:
    """After a profiled start a worker records its KV cache bytes under a key of everything
    they depend on; kvpush up starts a GPU's engines together only when every one of them
    has such a record (no memory profiling then), else one after the other."""
    from kvpush.services.up import Stack
    from kvpush.services.up_child import gpus_started_together
    from kvpush.services.workers import kv_memory

    monkeypatch.setenv("KVPUSH_CACHE", str(tmp_path / "cache" / "models"))
    monkeypatch.setattr(kv_memory, "gpu_identity", lambda gpu: f"NVIDIA H200 #{gpu}, 143771 MiB")
    flags = ("--device", "cuda", "--load-format", "dummy", "--log-dir", str(tmp_path))
    stack = Stack(UpConfig.from_args(parse(UP_SETTINGS, *flags), {}))
    stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    stack._plan()
    assert [c.gpu for c in stack.workers] == [0, 0]
    assert gpus_started_together(stack.workers) == set()  # nothing remembered: in turn
    stack._gate(set())  # D's worker starts at once (imports vLLM), its engine waits its turn
    prefill, decode = stack.workers
    assert prefill.gate is None and decode.gate is not None and decode.gated
    assert decode.argv[-2:] == ["--start-after", str(decode.gate)]
    at = decode.argv.index("kvpush.services.cli") + 1
    gated = worker_config.config_from_args(
        WorkerRole.DECODE, parse(worker_flags.SETTINGS, *decode.argv[at + 1 :]), {}
    ).engine_config()
    assert gated.start_gate == str(decode.gate)
    decode.open_gate()
    assert not decode.gated and decode.gate.exists()
    shutil.rmtree(stack.gate_dir)

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    keys = []
    for child in stack.workers:
        at = child.argv.index("kvpush.services.cli") + 1
        args = parser.parse_args(child.argv[at + 1 :])
        engine = worker_config.config_from_args(WorkerRole(child.argv[at]), args).engine_config()
        keys.append(kv_memory.key_of(engine))
    assert None not in keys and keys[0] != keys[1]  # P and D: a record each
    kv_memory.remember(keys[0], 40 << 30, {})
    assert gpus_started_together(stack.workers) == set()  # D would still profile
    kv_memory.remember(keys[1], 41 << 30, {})
    assert gpus_started_together(stack.workers) == {0}
    assert kv_memory.remembered(keys[1]) == 41 << 30
    other = UpConfig.from_args(parse(UP_SETTINGS, *flags, "--gpu-memory-utilization", "0.3"), {})
    moved = Stack(other)
    moved.nats_url, moved.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    moved._plan()
    assert gpus_started_together(moved.workers) == set()  # another share: profiled again
    moved._gate({0})  # every engine of GPU 0 remembers its KV size: none waits
    assert all(c.gate is None for c in moved.workers) and not moved.gate_dir


def test_an_engine_waits_for_its_turn_on_the_gpu(tmp_path) -> None:
    """--start-after FILE: the engine is built once FILE exists (it says so, once)."""
    from kvpush.services.workers.engine_config import EngineConfig, wait_for_gate

    said: list[str] = []
    wait_for_gate(EngineConfig(model_dir="m"), said.append)  # no gate: at once
    gate = tmp_path / "decode-0.turn"
    waiting = threading.Thread(
        target=wait_for_gate, args=(EngineConfig(model_dir="m", start_gate=str(gate)), said.append)
    )
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and said == [
        "waiting for its GPU (another engine is measuring its memory)"
    ]
    gate.touch()
    waiting.join(10)
    assert not waiting.is_alive() and len(said) == 1


def test_kvpush_up_gives_its_routing_policy_to_the_gateway(tmp_path) -> None:
    from kvpush.services.up import Stack

    def gateway_routing(*flags: str) -> object:
        up = UpConfig.from_args(parse(UP_SETTINGS, *flags, "--log-dir", str(tmp_path)), {})
        stack = Stack(up)
        stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
        stack._plan()
        assert stack.gateway is not None
        argv = stack.gateway.argv
        gateway_args = argparse.ArgumentParser()
        gateway_config.add_arguments(gateway_args)
        cli_args = gateway_args.parse_args(argv[argv.index("gateway") + 1 :])
        return gateway_config.GatewayConfig.from_args(cli_args, {}).routing

    assert str(getattr(gateway_routing("--routing", "least-loaded"), "value", "")) == "least-loaded"
    assert str(getattr(gateway_routing(), "value", "")) == "routed"  # the gateway's default


def test_a_worker_names_its_gpu_in_heartbeats_as_its_engine_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers on one GPU name it alike (the router does not overlap their prefills)."""
    import socket

    def named(device: str, gpu: int | None, cores: list[int] | None = None) -> str:
        config = worker_config.WorkerConfig(
            WorkerRole.DECODE, "d", "m", "m", device=device, gpu=gpu, cpu_cores=cores
        )
        return config.gpu_identity

    host = socket.gethostname()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert named("cpu", None) == ""  # a CPU engine on any core: no device known
    assert named("cpu", None, [1]) == f"{host}/cpu1"  # pinned: its cores are its device
    assert named("cpu", None, [3, 2, 3]) == f"{host}/cpu2,3"  # the same cores, the same name
    assert named("cuda", 1) == f"{host}/gpu1"
    assert named("cuda", None) == f"{host}/gpu0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert named("cuda", 1) == f"{host}/gpu1"  # --gpu is the engine's CUDA_VISIBLE_DEVICES
    assert named("cuda", None) == f"{host}/gpu3"  # none given: the first GPU it inherits


def test_decode_batches_long_local_prefills_unless_told_to_take_them_one_a_step(
    tmp_path,
) -> None:
    """``--serial-prefill-tokens``: 0 (vLLM's batching) on CUDA and CPU, a flag over either; a
    negative one is a ConfigError."""
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)

    def serial(*flags: str) -> int:
        args = parser.parse_args(["--model", str(tmp_path), *flags])
        cfg = worker_config.config_from_args(WorkerRole.DECODE, args, {}).engine_config()
        return cfg.kv_transfer_config["kv_connector_extra_config"]["serial_prefill_tokens"]

    assert (serial("--device", "cuda"), serial("--device", "cpu")) == (0, 0)
    assert serial("--device", "cuda", "--serial-prefill-tokens", "512") == 512
    assert serial("--device", "cpu", "--serial-prefill-tokens", "1024") == 1024
    with pytest.raises(ConfigError, match="--serial-prefill-tokens must be >= 0"):
        serial("--serial-prefill-tokens", "-1")
    # kvpush up hands a given 0 on (0 turns the rule off; not given: the workers' default)
    from kvpush.services.up import Stack

    for given, passed in ((("--serial-prefill-tokens", "0"), ["0"]), ((), [])):
        flags = (*given, "--log-dir", str(tmp_path))
        stack = Stack(UpConfig.from_args(parse(UP_SETTINGS, *flags), {}))
        stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
        stack._plan()
        for child in stack.workers:
            argv = child.argv
            at = [i + 1 for i, flag in enumerate(argv) if flag == "--serial-prefill-tokens"]
            assert [argv[i] for i in at] == passed, argv


def test_every_service_sets_its_gil_switch_interval_from_one_variable() -> None:
    before = sys.getswitchinterval()
    try:
        assert settings.apply_gil_switch({}) == switching.DEFAULT_SWITCH_US
        assert sys.getswitchinterval() == pytest.approx(switching.DEFAULT_SWITCH_US / 1e6)
        assert settings.apply_gil_switch({"KVPUSH_GIL_SWITCH_US": " 5000 "}) == 5000
        assert sys.getswitchinterval() == pytest.approx(0.005)
        for bad, why in (("fast", "whole number"), ("0", "outside"), ("200000", "outside")):
            with pytest.raises(ConfigError, match=f"KVPUSH_GIL_SWITCH_US.*{why}"):
                settings.apply_gil_switch({"KVPUSH_GIL_SWITCH_US": bad})
            assert sys.getswitchinterval() == pytest.approx(0.005)  # unchanged by a refusal
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["decode", "--model", "MODEL"], "kvpush decode: "),
        (["prefill", "--model", "MODEL"], "kvpush prefill: "),
        (["gateway"], "kvpush gateway: "),
        (["up"], "[kvpush up] configuration: "),
    ],
)
def test_a_service_refuses_an_unusable_gil_switch_interval_in_one_line(
    argv, line, tmp_path, monkeypatch, capsys
) -> None:
    from kvpush.services import cli

    def started(*_: object, **__: object) -> None:
        raise AssertionError("the service started")

    monkeypatch.setattr(asyncio, "run", started)  # a refusal comes before the service runs
    monkeypatch.setenv("KVPUSH_GIL_SWITCH_US", "soon")
    before = sys.getswitchinterval()
    argv = [str(tmp_path) if arg == "MODEL" else arg for arg in argv]
    assert cli.main(argv) == 2
    assert sys.getswitchinterval() == before
    captured = capsys.readouterr()
    lines = (captured.err + captured.out).strip().splitlines()
    why = "KVPUSH_GIL_SWITCH_US='soon': not a whole number of microseconds"
    assert lines == [line + why]


def test_the_engines_processes_set_the_interval_where_vllm_builds_the_connector() -> None:
    """vLLM builds ``KVPushConnector`` in its engine-core process and in every TP rank's (no
    kvpush entry point runs there): its constructor sets the interval (read, not run: the unit
    tier imports no vLLM)."""
    import ast
    from pathlib import Path

    import kvpush.connector

    source = Path(kvpush.connector.__file__).parent / "vllm" / "connector.py"
    tree = ast.parse(source.read_text())
    connector = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "KVPushConnector"
    )
    init = next(
        node
        for node in connector.body
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    called = {
        node.func.id
        for node in ast.walk(init)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "apply_switch_interval" in called
