"""Integration fixtures: the tiny model and the session's prefill + decode engines.

Engines start once per session (each ~10 s on these machines), pinned to different cores
(P on core 0, D on core 1), with ``KVPushConnector`` and the session's nats-server.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.connector.bus import Bus
from kvpush.services import models
from kvpush.services.natsd import EmbeddedNats
from tests.integration.engine_proc import D_CORES, P_CORES, EngineProc, start_engine
from tests.integration.gateway_fakes import Stacks, write_model_dir

PREFILL_ID = "p0"
DECODE_ID = "d0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_model(models.TINY, tmp_path_factory.mktemp("models") / "tiny")


def connector_config(role: str, worker_id: str, nats_url: str, **extra: Any) -> dict[str, Any]:
    """A KVTransferConfig dict; a fault (``fault_layer_delay_ms``) selects the test connector."""
    faulty = "fault_layer_delay_ms" in extra
    return {
        "kv_connector": "SlowPrefillConnector" if faulty else "KVPushConnector",
        "kv_connector_module_path": "kvpush.connector.vllm."
        + ("faults" if faulty else "connector"),
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "worker_id": worker_id,
            "role": role,
            "nats_url": nats_url,
            **extra,
        },
    }


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def pd_engines(
    tiny_model: Path, nats_server: EmbeddedNats, engine_logs: Path
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """The session's prefill (P, core 0) and decode (D, core 1) engines, started in parallel; D
    admits long prompts it computes itself one a step (``serial_prefill_tokens`` 512, the opt-in
    ``--serial-prefill-tokens`` under test; kvpush's workers keep vLLM's batching by default)."""
    names = (("P", PREFILL_ID, P_CORES), ("D", DECODE_ID, D_CORES))
    serial = {"serial_prefill_tokens": 512}
    engines = start_pair(tiny_model, nats_server.url, engine_logs, names, decode_settings=serial)
    yield engines
    for engine in engines:
        engine.stop()


def start_pair(
    model: Path,
    url: str,
    logs: Path,
    names: tuple[tuple[str, str, list[int]], tuple[str, str, list[int]]],
    decode_settings: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[EngineProc, EngineProc]:
    """A prefill and a decode engine ((log name, worker id, cores) each), started in parallel;
    ``decode_settings`` are ConnectorSettings of D, ``overrides`` EngineConfig fields of both."""
    (p_name, p_id, p_cores), (d_name, d_id, d_cores) = names
    p_config = connector_config("prefill", p_id, url)
    d_config = connector_config(
        "decode", d_id, url, transfer_timeout_s=20.0, **(decode_settings or {})
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(
            start_engine, p_name, model, p_cores, logs, kv_transfer_config=p_config, **overrides
        )
        decode = pool.submit(
            start_engine, d_name, model, d_cores, logs, kv_transfer_config=d_config, **overrides
        )
        return prefill.result(), decode.result()


def wait_for(
    predicate: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)


@pytest.fixture
def no_leaked_blocks(pd_engines: tuple[EngineProc, EngineProc]) -> Iterator[None]:
    """Both engines end the test with exactly the free blocks they started with."""
    start = [engine.free_blocks() for engine in pd_engines]
    yield
    for engine, before in zip(pd_engines, start, strict=True):
        wait_for(
            lambda e=engine, b=before: e.free_blocks() == b,
            15.0,
            f"engine {engine.name} back to {before} free blocks",
        )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer-only model folder for gateway tests (no weights: no engine reads it)."""
    return write_model_dir(tmp_path_factory.mktemp("gateway-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
async def stack(bus: Bus, model_dir: Path, nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    """Gateways plus fake workers on the session's nats-server (tests/integration/gateway_fakes)."""
    async with Stacks(bus, model_dir, nats_server.url) as make:
        yield make


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Random prompts, different per test (prefix caches never join two tests by accident)."""
    return random.Random(request.node.nodeid)
