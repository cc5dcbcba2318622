"""EngineHost drives a real vLLM CPU engine correctly: outputs, lengths, aborts, stop strings.

One engine (no connector) runs in a child process pinned to core 0 (``EngineProc``); the
reference output comes from ``generate_greedy`` in a subprocess pinned to core 1, started
before the engine so the two builds overlap. pytest itself never imports vllm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.models import TINY, build_model
from tests.integration.engine_proc import D_CORES, P_CORES, EngineProc, start_engine

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PROMPTS = [
    "Hello there",
    "",  # BOS only
    "1 2 3",
    "Flitul quean pyst, the plel of stroun: " * 24,  # > 2 blocks of 128 tokens
]

_REFERENCE = """
import json, os, sys
from kvpush.services.models import generate_greedy
if __name__ == "__main__":
    os.sched_setaffinity(0, json.loads(sys.argv[4]))
    result = generate_greedy(sys.argv[1], json.loads(sys.argv[3]), int(sys.argv[2]))
    with open(sys.argv[5], "w") as f:
        json.dump(result, f)
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(TINY, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def reference(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Starts generate_greedy at once; calling the fixture value waits for its output."""
    out = tmp_path_factory.mktemp("reference") / "greedy.json"
    args = [str(tiny_dir), str(MAX_TOKENS), json.dumps(PROMPTS), json.dumps(D_CORES), str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _REFERENCE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def result() -> list[dict[str, Any]]:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-4000:]
        return json.loads(out.read_text())

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def engine(
    tiny_dir: Path, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProc]:
    proc = start_engine("solo", tiny_dir, P_CORES, log_dir=tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


def _request(ids: list[int], **sampling: Any) -> dict[str, Any]:
    """A greedy request with a fresh id and its own cache salt (no prefix hits across tests)."""
    return {
        "request_id": f"req-{uuid.uuid4().hex[:8]}",
        "prompt_token_ids": ids,
        "sampling": {"temperature": 0.0, **sampling},
        "cache_salt": uuid.uuid4().hex,
    }


def test_greedy_batch_matches_generate_greedy(
    engine: EngineProc, tokenizer: Any, reference: Callable[[], list[dict[str, Any]]]
) -> None:
    requests = [_request(tokenizer(p)["input_ids"], max_tokens=MAX_TOKENS) for p in PROMPTS]
    results = engine.generate(requests, timeout=60)
    expected = reference()

    assert "vllm" not in sys.modules  # engines live in child processes only

    for prompt, got, want in zip(PROMPTS, results, expected, strict=True):
        assert got["error"] is None, got
        assert got["finish_reason"] == "length", got
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["text"] == want["text"], prompt
        assert got["first_output_s"] <= got["total_s"]


def test_concurrent_requests_finish_with_their_own_lengths(
    engine: EngineProc, tokenizer: Any
) -> None:
    lengths = [1, 2, 5, 9, 17, 33, 64]
    ids = tokenizer("Concurrent requests share one engine")["input_ids"]
    requests = [_request(ids, max_tokens=n, ignore_eos=True) for n in lengths]

    results = engine.generate(requests, timeout=60)

    assert [r["request_id"] for r in results] == [r["request_id"] for r in requests]
    assert [len(r["token_ids"]) for r in results] == lengths
    assert {r["finish_reason"] for r in results} == {"length"}
    # Greedy and the same prompt: every shorter output is a prefix of the longest one.
    longest = results[-1]["token_ids"]
    assert all(r["token_ids"] == longest[: len(r["token_ids"])] for r in results)


def test_abort_of_a_running_request_ends_it_and_frees_its_blocks(
    engine: EngineProc, tokenizer: Any
) -> None:
    free_before = engine.free_blocks()
    assert 0 < free_before <= engine.total_blocks()
    ids = tokenizer(PROMPTS[-1])["input_ids"]
    assert len(ids) > 256  # three blocks at least
    request = _request(ids, max_tokens=3000, ignore_eos=True)
    [rid] = engine.submit([request])

    assert engine.wait_tokens(rid, 2, timeout=30) >= 2
    assert engine.free_blocks() <= free_before - 3  # the running request holds its blocks
    engine.abort(rid)
    [result] = engine.collect([rid], timeout=30)

    assert result["finish_reason"] == "abort", result
    assert 2 <= len(result["token_ids"]) < 3000
    assert engine.free_blocks() == free_before


def test_stop_string_ends_the_request_with_finish_reason_stop(
    engine: EngineProc, tokenizer: Any
) -> None:
    ids = tokenizer("1 2 3")["input_ids"]
    [free_run] = engine.generate([_request(ids, max_tokens=24)])
    text = free_run["text"]
    stop = text[len(text) // 2 :][:4]  # a string first seen somewhere after the first token
    assert stop.strip() and text.index(stop) > 0, text

    [stopped] = engine.generate([_request(ids, max_tokens=24, stop=[stop])])

    assert stopped["finish_reason"] == "stop", stopped
    assert stopped["text"] == text[: text.index(stop)]
    assert len(stopped["token_ids"]) < len(free_run["token_ids"])


def test_a_rejected_request_fails_alone(engine: EngineProc, tokenizer: Any) -> None:
    ok = _request(tokenizer("fine")["input_ids"], max_tokens=4)
    too_long = _request([5] * 5000, max_tokens=4)  # over max_model_len

    bad, good = engine.generate([too_long, ok], timeout=30)

    assert bad["finish_reason"] == "error" and "maximum model length" in bad["error"], bad
    assert good["finish_reason"] == "length" and len(good["token_ids"]) == 4, good


def test_cache_salt_scopes_prefix_hits_and_reset_clears_them(
    engine: EngineProc, tokenizer: Any
) -> None:
    ids = tokenizer(PROMPTS[-1])["input_ids"]
    salted = _request(ids, max_tokens=1)
    full_blocks = len(ids) // 128 * 128

    [first] = engine.generate([salted])
    [again] = engine.generate([{**salted, "request_id": "same-salt"}])
    [other] = engine.generate([_request(ids, max_tokens=1)])  # a fresh salt
    assert engine.reset_prefix_cache()
    [after_reset] = engine.generate([{**salted, "request_id": "after-reset"}])

    assert first["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] == full_blocks
    assert other["num_cached_tokens"] == 0
    assert after_reset["num_cached_tokens"] == 0
    assert again["token_ids"] == first["token_ids"] == other["token_ids"]
