"""The tiny model loads in real vLLM (CPU) and decodes greedily, visibly and reproducibly.

vLLM runs in a subprocess pinned to one core, never inside the pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpush.services.models import TINY, build_model

pytestmark = pytest.mark.engine

PROMPTS = ["Hello there", "", "1 2 3"]  # "" (just BOS) hits invisible tokens if unmasked
MAX_TOKENS = 16

_GENERATE = """
import json, sys
from kvpush.services.models import generate_greedy
if __name__ == "__main__":
    model_dir, out_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.loads(sys.argv[4])
    result = generate_greedy(model_dir, prompts, max_tokens)
    with open(out_file, "w") as f:
        json.dump(result, f)
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(TINY, tmp_path_factory.mktemp("models") / "tiny")


def _generate_in_subprocess(model_dir: Path, out_file: Path) -> list[dict[str, Any]]:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0", HF_HUB_OFFLINE="1")
    args = [str(model_dir), str(out_file), str(MAX_TOKENS), json.dumps(PROMPTS)]
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_file.read_text())


def test_tiny_model_greedy_output_is_visible_and_reproducible(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    first = _generate_in_subprocess(tiny_dir, tmp_path / "first.json")
    second = _generate_in_subprocess(tiny_dir, tmp_path / "second.json")

    assert [r["prompt"] for r in first] == PROMPTS
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in second]
    assert [r["text"] for r in first] == [r["text"] for r in second]

    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    special_ids = {tokenizer.token_to_id(t) for t in special}
    assert len(special_ids) >= 5
    for result in first:
        # EOS rows are zeroed in lm_head, so greedy never stops before max_tokens.
        assert len(result["token_ids"]) == MAX_TOKENS
        assert not special_ids & set(result["token_ids"]), result
        assert result["text"].strip(), result
        assert result["text"].isascii(), result
        assert tokenizer.decode(result["token_ids"], skip_special_tokens=False) == result["text"]
