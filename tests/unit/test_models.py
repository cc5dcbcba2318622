"""Local model builder: tokenizer, chat template, determinism, idempotency (no vLLM here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.services import models
from kvpush.services.model_tokenizer import SPECIAL_TOKENS
from kvpush.services.models import STAMP_FILE, TINY, build_model

transformers = pytest.importorskip("transformers")


def _hashes(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(TINY, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def test_build_writes_a_complete_hf_llama_directory(tiny_dir: Path) -> None:
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        STAMP_FILE,
    }
    assert {p.name for p in tiny_dir.iterdir()} == expected
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == TINY.layers
    assert config["hidden_size"] == TINY.hidden
    assert config["num_key_value_heads"] == TINY.kv_heads
    assert config["head_dim"] == 32
    assert config["tie_word_embeddings"] is False
    assert "chat_template" in json.loads((tiny_dir / "tokenizer_config.json").read_text())
    stamp = json.loads((tiny_dir / STAMP_FILE).read_text())
    assert stamp["recipe"] == dataclasses.asdict(TINY)
    assert {n: m["sha256"] for n, m in stamp["files"].items()} == {
        n: h for n, h in _hashes(tiny_dir).items() if n != STAMP_FILE
    }


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=string.printable, max_size=200))
def test_tokenizer_round_trips_printable_ascii(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text


def test_tokenizer_has_special_tokens_and_prepends_bos(tokenizer) -> None:
    assert len(tokenizer) == TINY.vocab_size
    for token in SPECIAL_TOKENS:
        assert token in tokenizer.all_special_tokens
        assert tokenizer.encode(token, add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids(token)
        ]
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    ids = tokenizer.encode("hello world")
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"


def test_chat_template_renders_roles_and_generation_prompt(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|system|>\nbe brief<|end|>\n<|user|>\nhi there<|end|>\n"
        "<|assistant|>\nhello<|end|>\n<|user|>\nagain<|end|>\n<|assistant|>\n"
    )
    without = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert not without.endswith("<|assistant|>\n")
    with pytest.raises(Exception, match="roles must be"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_lm_head_rows_of_invisible_tokens_are_zero(tiny_dir: Path, tokenizer) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(tiny_dir / "model.safetensors"))
    lm_head = weights["lm_head.weight"]
    assert tuple(lm_head.shape) == (TINY.vocab_size, TINY.hidden)
    assert not lm_head.equal(weights["model.embed_tokens.weight"])
    zero_rows = {i for i in range(TINY.vocab_size) if not lm_head[i].any()}
    assert set(tokenizer.all_special_ids) <= zero_rows
    assert tokenizer.convert_tokens_to_ids("Ġ") in zero_rows  # a lone space
    for token_id in range(TINY.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        visible = text.strip() and text.isascii() and text.isprintable()
        assert (token_id in zero_rows) != bool(visible), (token_id, text)


def test_greedy_decoding_emits_only_visible_tokens(tiny_dir: Path, tokenizer) -> None:
    torch = pytest.importorskip("torch")
    model = transformers.LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    special = set(tokenizer.all_special_ids)
    for prompt in ["Hello there", "1 2 3", "", "   "]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            for _ in range(8):
                next_id = int(model(ids).logits[0, -1].argmax())
                assert next_id not in special
                text = tokenizer.decode([next_id])
                assert text.strip() and text.isascii(), (prompt, next_id, text)
                ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)


def test_builds_in_two_processes_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "tiny-again"
    code = (
        "import sys; from kvpush.services.models import TINY, build_model; "
        "build_model(TINY, sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(other)], check=True, timeout=120)
    assert _hashes(other) == _hashes(tiny_dir)


def test_rebuild_of_same_recipe_returns_at_once_without_rewriting(tiny_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    messages: list[str] = []
    assert build_model(TINY, tiny_dir, messages.append) == tiny_dir
    assert messages == [f"kvpush-tiny already built in {tiny_dir}"]
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_build_of_another_recipe_replaces_the_model(tiny_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "m"
    build_model(TINY, target)
    first = _hashes(target)
    assert first == _hashes(tiny_dir)
    reseeded = dataclasses.replace(TINY, seed=1)
    steps: list[str] = []
    build_model(reseeded, target, steps.append)
    assert steps[0] == "training tokenizer"
    second = _hashes(target)
    assert second["model.safetensors"] != first["model.safetensors"]
    assert json.loads((target / STAMP_FILE).read_text())["recipe"]["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp or old dirs left


def test_failed_build_leaves_no_half_model(tmp_path: Path, monkeypatch) -> None:
    def crash(*_args: object) -> None:
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(models, "_write_weights", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_model(TINY, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_model(TINY, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_default_model_cache_dir_honours_kvpush_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVPUSH_CACHE", str(tmp_path))
    assert models.default_model_cache_dir() == tmp_path
    monkeypatch.delenv("KVPUSH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_model_cache_dir() == tmp_path / "home" / ".cache" / "kvpush" / "models"


def test_presets_have_head_dims_vllm_cpu_supports() -> None:
    assert (models.TINY.head_dim, models.BENCH.head_dim) == (32, 64)
    assert set(models.RECIPES) == {"tiny", "bench", "llama-8b", "llama-70b"}
    assert (models.LLAMA_8B.head_dim, models.LLAMA_70B.head_dim) == (128, 128)


def test_a_gpu_shape_is_config_and_tokenizer_only_and_loads_with_dummy_weights(
    tmp_path: Path,
) -> None:
    out = models.build_model(models.LLAMA_8B, tmp_path / "m8b")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" not in names and {"config.json", "tokenizer.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (32, 4096)
    assert (config["num_key_value_heads"], config["dtype"]) == (8, "bfloat16")
