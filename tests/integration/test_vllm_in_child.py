"""Unit-sized checks that need vLLM itself: kvpush's SamplingParams, its one change to a vLLM
``Request``, the connector's scheduler half, vLLM's engine-flag parser and config hash.

They live in the engine tier because each runs vLLM in a child interpreter (the suite's process
never imports vLLM; ``in_child`` and ``python -c`` scripts), which costs seconds per test: the
fast tier (tests/unit) stays free of vLLM. Threading: none; each child is one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvpush.schemas.messages import WorkerRole
from kvpush.services.settings import ConfigError
from kvpush.services.up_config import SETTINGS as UP_SETTINGS
from kvpush.services.up_config import UpConfig
from kvpush.services.workers import config as worker_config
from tests.unit.test_connector_sides import BLOCK
from tests.unit.test_settings import parse

# ---- each answer's SamplingParams, on real vLLM --------------------------------------------
ENGINE_PARAMS = """
import msgspec
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from kvpush.connector.params import samples_on_prefill
from kvpush.schemas.sampling import SamplingSpec, StructuredOutputs
from kvpush.services.workers.fanout import engine_params

spec = SamplingSpec(
    max_tokens=9, min_tokens=2, n=3, temperature=0.8, top_p=0.9, top_k=5, min_p=0.05,
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, seed=7,
    stop=["x"], stop_token_ids=[3], include_stop_str_in_output=True, ignore_eos=True,
    logprobs=2, prompt_logprobs=1, logit_bias={5: 1.5}, allowed_token_ids=[5, 6, 7],
    bad_words=["no"], skip_special_tokens=False, spaces_between_special_tokens=False,
    structured_outputs=StructuredOutputs(json='{"type": "object"}', disable_any_whitespace=True),
)
kv = {"kvpush": {"transfer_id": "t"}}
zero, two = engine_params(spec, 0, kv), engine_params(spec, 2, kv)
for name in SamplingSpec.__struct_fields__:
    if name not in ("n", "seed", "prompt_logprobs", "structured_outputs"):
        assert getattr(zero, name) == getattr(spec, name), name
        assert getattr(two, name) == getattr(spec, name), name
assert (zero.n, zero.seed, two.n, two.seed) == (1, 7, 1, 9)
assert (zero.prompt_logprobs, two.prompt_logprobs) == (1, None)
assert zero.output_kind == RequestOutputKind.DELTA == two.output_kind
assert zero.extra_args == {"kv_transfer_params": kv} and not two.extra_args
# --kv-events on: vLLM reports a prefix-cache hit as a store (its "full" report mode)
full = {"kv_cache_report_mode": "full"}
assert engine_params(spec, 0, kv, True).extra_args == {"kv_transfer_params": kv, **full}
assert engine_params(spec, 2, kv, True).extra_args == full
assert isinstance(zero.structured_outputs, StructuredOutputsParams)
assert zero.structured_outputs.json == '{"type": "object"}'
assert zero.structured_outputs.disable_any_whitespace and two.structured_outputs.json
assert list(zero.logit_bias) == [5] and isinstance(list(zero.logit_bias)[0], int)
plain = engine_params(SamplingSpec(max_tokens=4, temperature=0.0))
assert plain.seed is None and plain.extra_args is None and plain.structured_outputs is None
assert samples_on_prefill(plain) and not samples_on_prefill(zero)
assert not samples_on_prefill(engine_params(SamplingSpec(temperature=0.0, bad_words=["b"])))
print("ok")
"""


def test_each_answer_gets_the_request_s_sampling_as_vllm_params() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PARAMS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---- the one change to a vLLM Request (in a child process: vLLM stays out of pytest's) -----
CONTINUE_FROM = f"""
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from kvpush.connector.vllm import compat

B = {BLOCK}
init_none_hash(sha256)
params = SamplingParams(max_tokens=5, min_tokens=2)
req = Request("r0", list(range(2 * B - 1)), params, None,
              block_hasher=get_request_block_hasher(B, sha256))
assert len(req.block_hashes) == 1
compat.continue_from(req, 99)
assert req.prompt_token_ids[-1] == 99 and req.num_prompt_tokens == 2 * B
assert list(req.all_token_ids) == [*range(2 * B - 1), 99] and req.num_tokens == 2 * B
assert len(req.block_hashes) == 2, "the block the token completed is hashed"
got = (req.max_tokens, req.sampling_params.max_tokens, req.sampling_params.min_tokens)
assert got == (4, 4, 1), got
assert (params.max_tokens, params.min_tokens) == (5, 2), "the caller's object is untouched"
print("ok")
"""


def test_continue_from_makes_the_token_the_last_prompt_token_of_a_real_request() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CONTINUE_FROM], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---- the scheduler half's bookkeeping (in a child process, like the Request above) ----------
SCHEDULER_HALF = f"""
from types import SimpleNamespace as NS
from vllm import SamplingParams
from kvpush.connector.params import ConnectorSettings, PrefillToken, TransferParams
from kvpush.connector.vllm import compat
from kvpush.connector.vllm.metadata import KVPushWorkerMeta
from kvpush.connector.vllm.scheduler import SchedulerHalf
from kvpush.schemas.messages import WorkerRole

B, continued = {BLOCK}, []
compat.continue_from = lambda req, token_id: continued.append((req.request_id, token_id))

def half(free=10, driver=True):
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE)
    h = SchedulerHalf(settings, B, f"t-{{len(continued)}}-{{free}}-{{driver}}", 1000)
    h.driver_takes_tokens, h.free_blocks = driver, (lambda: free)
    return h

def request(rid, n=B + 1, **sampling):
    params = TransferParams(f"tx-{{rid}}xxxx", "p0", "d0", first_token_from_prefill=True)
    sp = SamplingParams(max_tokens=8, **sampling)
    return NS(request_id=rid, kv_transfer_params=params.to_params(), num_prompt_tokens=n,
              num_tokens=n, max_tokens=8, sampling_params=sp, status=NS(name="RUNNING"))

def alloc(h, req):
    blocks = NS(get_block_ids=lambda: (list(range(9)),))
    h.update_state_after_alloc(req, blocks, req.num_prompt_tokens)
    return h._meta.decode[-1].params.first_token_from_prefill

def step(h, tokens, finished):
    out = NS(kv_connector_worker_meta=KVPushWorkerMeta({{}}, tokens),
             finished_recving=set(finished), finished_sending=set())
    h.update_connector_output(out)
    return h.take_prefill_tokens()

# a rank's token a step before the receive ends (TP) is kept for it
h = half()
assert alloc(h, request("a"))
assert step(h, {{"a": PrefillToken(5), "x": PrefillToken(6)}}, []) == []
assert "x" not in h._prefill_tokens  # a request that did not ask: dropped
assert step(h, {{}}, ["a"]) == [("a", PrefillToken(5))] and continued == [("a", 5)]
assert h._marks.take("tx-axxxx").prefill_token > 0  # D continued from P's token
# a request that ends while waiting forgets its token
assert alloc(h, request("b"))
ended = NS(request_id="b", kv_transfer_params=None, status=NS(name="FINISHED_ABORTED"))
h.request_finished(ended, [])
assert step(h, {{"b": PrefillToken(7)}}, ["b"]) == [] and "b" not in h._requests_awaiting_token
# without a driver, with log-probabilities or seeded sampling, D samples the token itself
assert not alloc(half(driver=False), request("c"))
assert not alloc(h, request("d", logprobs=2))
assert not alloc(h, request("e", temperature=0.7, seed=3))
assert alloc(h, request("f", temperature=0.7))  # unseeded: P's draw is as good as D's
# a token whose KV opens a block continues only while a free block is left for it
h0 = half(free=1)
for rid in ("g", "i"):
    assert alloc(h0, request(rid, n=2 * B))
got = step(h0, {{"g": PrefillToken(1), "i": PrefillToken(2)}}, ["g", "i"])
assert got in ([("g", PrefillToken(1))], [("i", PrefillToken(2))]), got  # the one free block
# an aborted request's marks stay for the driver (its output is already out)
h._marks.record("tx-jxxxx", kv_landed=1)
aborted = NS(request_id="j", kv_transfer_params=request("j").kv_transfer_params,
             status=NS(name="FINISHED_ABORTED"))
assert h.request_finished(aborted, []) == (False, None)
assert h.take_timing("tx-jxxxx").kv_landed == 1
# every rank's tokens merge
merged = KVPushWorkerMeta({{}}, {{"a": PrefillToken(1)}}).aggregate(
    KVPushWorkerMeta({{}}, {{"b": PrefillToken(2)}}))
assert merged.first_tokens == {{"a": PrefillToken(1), "b": PrefillToken(2)}}
for x in (h, h0):
    x.shutdown()
print("ok")
"""


def test_the_scheduler_half_keeps_continues_and_forgets_prefill_tokens() -> None:
    """A token from one rank waits for the receive's end; tokens nobody asked for, and those of
    requests that ended, are dropped; no driver, log-probabilities or seeded sampling: D
    samples the token itself; a token whose KV needs a new block continues only while one is
    free; an aborted request's marks stay for the driver; the ranks' tokens merge."""
    done = subprocess.run(
        [sys.executable, "-c", SCHEDULER_HALF], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_vllm_engine_flags_reach_each_roles_engines_and_the_ones_kvpush_sets_are_refused(
    tmp_path, in_child
) -> None:
    """--engine-arg carries any `vllm serve` engine flag, parsed by vLLM's own parser (its
    types, its errors, at start); kvpush up gives --engine-arg to every worker and
    --prefill-engine-arg / --decode-engine-arg to one role's; what kvpush sets is refused.
    (In a child interpreter: vLLM's parser is vLLM.)"""
    if not in_child:
        return
    from kvpush.services.up import Stack
    from kvpush.services.workers.engine_config import engine_kwargs

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)

    def worker(*flags: str) -> worker_config.WorkerConfig:
        args = parser.parse_args(["--model", str(tmp_path), "--device", "cpu", *flags])
        return worker_config.config_from_args(WorkerRole.DECODE, args, {})

    flags = ("--engine-arg=--max-num-batched-tokens=16384", "--engine-arg=--kv-cache-dtype auto")
    kwargs = engine_kwargs(worker(*flags).engine_config())
    assert kwargs["max_num_batched_tokens"] == 16384 and kwargs["kv_cache_dtype"] == "auto"
    assert "max_num_batched_tokens" not in engine_kwargs(worker().engine_config())
    json_flag = '--engine-arg=--compilation-config={"max_cudagraph_capture_size": 64}'
    assert worker(json_flag).engine_args == (json_flag.removeprefix("--engine-arg="),)
    for flag, message in (
        ("--kv-transfer-config={}", "kvpush sets it"),
        ("--max-num-seqs=8", "use kvpush's --max-num-seqs"),
        ("--no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("--max-num-batched-tokens=many", "invalid"),
        ("--async-scheduling", "use --engine-core process"),  # CPU: the thread engine core
    ):
        with pytest.raises(ConfigError, match=message):
            worker(f"--engine-arg={flag}")

    flags = (
        "--engine-arg=--max-num-batched-tokens=4096",
        "--prefill-engine-arg=--max-num-batched-tokens=16384",
        "--decode-engine-arg=--no-enable-prefix-caching",
    )
    stack = Stack(UpConfig.from_args(parse(UP_SETTINGS, *flags, "--log-dir", str(tmp_path)), {}))
    stack.nats_url, stack.model_dir = "nats://127.0.0.1:1", str(tmp_path)
    stack._plan()
    roles = {
        child.argv[child.argv.index("kvpush.services.cli") + 1]: child for child in stack.workers
    }
    for role, own in (
        ("prefill", "--max-num-batched-tokens=16384"),
        ("decode", "--no-enable-prefix-caching"),
    ):
        argv = roles[role].argv
        args = parser.parse_args(argv[argv.index(role) + 1 :])
        config = worker_config.config_from_args(WorkerRole(role), args, {})
        assert config.engine_args == ("--max-num-batched-tokens=4096", own)
    assert engine_kwargs(config.engine_config())["enable_prefix_caching"] is False
    with pytest.raises(ConfigError, match="kvpush sets it"):
        UpConfig.from_args(parse(UP_SETTINGS, "--decode-engine-arg=--kv-transfer-config={}"), {})


def test_prefill_and_decode_engines_share_one_compile_cache(tmp_path, in_child) -> None:
    """vLLM keys its torch.compile cache by a hash of the engine's config: a P and a D of one
    model must hash alike in process mode (P runs without async scheduling, which vLLM lets
    into the key unless kvpush pins it), so the second engine to start loads the first one's
    compiled graphs. (In a child interpreter: it builds vLLM's configs.)"""
    if not in_child:
        return
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from kvpush.services.workers.config import default_model_dir
    from kvpush.services.workers.engine_config import engine_kwargs

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    model = str(default_model_dir())
    hashes = []
    for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
        args = parser.parse_args(["--model", model, "--device", "cpu", "--engine-core", "process"])
        cfg = worker_config.config_from_args(role, args, {}).engine_config()
        kwargs = engine_kwargs(cfg)
        kwargs["kv_transfer_config"] = KVTransferConfig(**(cfg.kv_transfer_config or {}))
        vllm_config = EngineArgs(**kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)
        hashes.append(vllm_config.compute_hash())
    assert kwargs.get("async_scheduling") is None  # D: vLLM's own choice; P: off
    assert hashes[0] == hashes[1]


def test_the_gateway_tokenizes_on_several_threads_unless_a_vllm_arg_says_otherwise(
    model_dir, in_child
) -> None:
    """vLLM's renderer tokenizes on one thread by default: requests that arrive together wait
    for each other's tokenization (8192-token prompts: tens of ms each). The gateway asks for
    up to ``TOKENIZER_THREADS`` (one per core at most); ``--vllm-arg`` still wins."""
    if not in_child:
        return
    from kvpush.services.gateway import config as gateway_config
    from kvpush.services.gateway.vllm_serving import build_serving, tokenizer_threads

    def threads(*flags: str) -> int:
        parser = argparse.ArgumentParser()
        gateway_config.add_arguments(parser)
        config = gateway_config.GatewayConfig.from_args(
            parser.parse_args(["--model", str(model_dir), *flags]), {}
        )
        return build_serving(config, "m", 512).vllm_config.model_config.renderer_num_workers

    assert threads() == tokenizer_threads() > 1 or len(os.sched_getaffinity(0)) == 1
    assert threads("--vllm-arg=--renderer-num-workers=1") == 1


# ---- the decode half's rule for long prompts D computes itself --------------------------------
SERIAL_PREFILL = """
import uuid
from types import SimpleNamespace as NS
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.vllm.scheduler import SchedulerHalf
from kvpush.schemas.messages import WorkerRole

def half(serial, role=WorkerRole.DECODE):
    settings = ConnectorSettings("unit", role, serial_prefill_tokens=serial)
    return SchedulerHalf(settings, 16, "unit-" + uuid.uuid4().hex[:8])

def local(tokens, skip_cache=False):  # no KV transfer params: D computes it
    return NS(request_id=uuid.uuid4().hex, kv_transfer_params=None, num_prompt_tokens=tokens,
              num_tokens=tokens, skip_reading_prefix_cache=skip_cache)

def ask(h, request, cached=0):
    return h.get_num_new_matched_tokens(request, cached)

h = half(512)
second = local(2048)
assert ask(h, local(2048)) == (0, False)
assert ask(h, second) == (None, False)  # a long one is in this step: the next
assert ask(h, local(300)) == (0, False)  # short: joins
assert ask(h, local(2048), 1600) == (0, False)  # 448 past the prefix hit: joins
h.build_connector_meta(NS(total_num_scheduled_tokens=1))
assert ask(h, second) == (0, False) and ask(h, local(4096)) == (None, False)
# prompt_logprobs (vLLM 0.32 reads no prefix cache and admits it anyway): the step's long one
h.build_connector_meta(NS(total_num_scheduled_tokens=1))
assert ask(h, local(2048, skip_cache=True)) == (0, False) and ask(h, local(2048)) == (None, False)
h.build_connector_meta(NS(total_num_scheduled_tokens=1))
assert ask(h, local(2048)) == (0, False)
assert ask(h, local(2048, skip_cache=True)) == (0, False)  # not None: 0.32 would admit it anyway
# 0: vLLM's batching; a prefill engine: never held back
others = [half(0), half(512, WorkerRole.PREFILL)]
for x in others:
    assert [ask(x, local(4096)) for _ in range(3)] == [(0, False)] * 3
for x in (h, *others):
    x.shutdown()
print("ok")
"""


def test_the_decode_half_admits_long_prompts_it_computes_one_a_step() -> None:
    """``serial_prefill_tokens``: a second long prompt D computes itself waits for the next
    step (``None``), short ones and those mostly cached join; a prompt_logprobs request is
    admitted and counts as the step's long one; 0 and a prefill engine hold nothing back."""
    done = subprocess.run(
        [sys.executable, "-c", SERIAL_PREFILL], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
