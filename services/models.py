"""Local random-weight Llama models for tests, demos and benchmarks.

Owns `ModelRecipe` and its presets (`TINY`: CI and `kvpush up`; `BENCH`: CPU benchmarks;
`LLAMA_8B` / `LLAMA_70B`: Llama-3 layer geometry for GPU benchmarks, config and tokenizer only,
served with vLLM's `load_format="dummy"`), `build_model` (a Hugging Face Llama folder vLLM loads
offline: config, float32 safetensors, the tokenizer of model_tokenizer.py, and a
`kvpush-model.json` stamp; deterministic, idempotent and atomic), `generate_greedy` (an
in-process vLLM engine) and `default_model_cache_dir` (where `kvpush up` caches models).

Random weights argmax to special or whitespace tokens surprisingly often, which makes greedy
output invisible; `build_model` zeroes the lm_head rows of every token that does not decode to
visible printable ASCII, so greedy decoding always emits visible text and never stops early.
Threading model: everything runs in the caller's thread; nothing here starts background work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.services import model_tokenizer
from kvpush.services.model_tokenizer import BOS, END_OF_TURN, EOS, PAD

STAMP_FILE = "kvpush-model.json"
STAMP_FORMAT = 1  # bump when the build changes the bytes it writes for a given recipe

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class ModelRecipe:
    """Everything that determines a built model's bytes (with STAMP_FORMAT)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab_size: int
    max_context: int
    seed: int = 0
    weights: bool = True  # False: no safetensors (vLLM load_format="dummy" fills them)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = ModelRecipe(
    "kvpush-tiny",
    layers=2,
    hidden=128,
    intermediate=256,
    heads=4,
    kv_heads=2,
    vocab_size=2048,
    max_context=4096,
)
BENCH = dataclasses.replace(
    TINY,
    name="kvpush-bench",
    layers=8,
    hidden=512,
    intermediate=1536,
    heads=8,
    kv_heads=4,
    vocab_size=8192,
)
# GPU shapes: Llama-3 geometry, the tiny model's tokenizer, bf16 weights vLLM makes up
LLAMA_8B = dataclasses.replace(
    TINY,
    name="kvpush-llama-8b-shape",
    layers=32,
    hidden=4096,
    intermediate=14336,
    heads=32,
    kv_heads=8,
    max_context=16384,
    weights=False,
)
LLAMA_70B = dataclasses.replace(
    LLAMA_8B, name="kvpush-llama-70b-shape", layers=80, hidden=8192, intermediate=28672, heads=64
)
RECIPES = {"tiny": TINY, "bench": BENCH, "llama-8b": LLAMA_8B, "llama-70b": LLAMA_70B}


def default_model_cache_dir() -> Path:
    """`$KVPUSH_CACHE` if set, else `~/.cache/kvpush/models`."""
    env = os.environ.get("KVPUSH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpush" / "models"


def read_stamp(model_dir: str | Path) -> dict[str, Any] | None:
    """The stamp of a built model, or None if `model_dir` holds no readable stamp."""
    try:
        return json.loads((Path(model_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_built(model_dir: Path, recipe: ModelRecipe) -> bool:
    stamp = read_stamp(model_dir)
    if not stamp or stamp.get("format") != STAMP_FORMAT:
        return False
    if stamp.get("recipe") != dataclasses.asdict(recipe):
        return False
    files = stamp.get("files", {})
    return all(
        (model_dir / name).is_file() and (model_dir / name).stat().st_size == meta["size"]
        for name, meta in files.items()
    )


def build_model(
    recipe: ModelRecipe, out_dir: str | Path, progress: ProgressFn | None = None
) -> Path:
    """Build `recipe` into `out_dir` (created, or replaced if it holds another kvpush model).

    Returns at once if `out_dir` already holds this recipe. Refuses to replace a non-empty
    directory that is not a kvpush model.
    """
    out = Path(out_dir).expanduser().resolve()
    report = progress or (lambda _msg: None)
    if _is_built(out, recipe):
        report(f"{recipe.name} already built in {out}")
        return out
    if out.exists() and any(out.iterdir()) and read_stamp(out) is None:
        raise FileExistsError(f"{out} is not empty and holds no {STAMP_FILE}; not replacing it")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        _build_into(recipe, tmp, report)
        _install(tmp, out, recipe)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(f"built {recipe.name} in {out} ({time.monotonic() - started:.1f} s)")
    return out


def _install(tmp: Path, out: Path, recipe: ModelRecipe) -> None:
    """Move a finished build into place; a concurrent builder of the same recipe may win."""
    old: Path | None = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if not _is_built(out, recipe):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build_into(recipe: ModelRecipe, tmp: Path, report: ProgressFn) -> None:
    report("training tokenizer")
    tokenizer = model_tokenizer.train_tokenizer(recipe.vocab_size, recipe.max_context, recipe.seed)
    report("initialising weights")
    _write_weights(recipe, tokenizer, tmp)
    report("writing tokenizer")
    model_tokenizer.write_tokenizer(tokenizer, tmp)
    report("hashing files")
    files = {
        p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    content = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    stamp = {
        "format": STAMP_FORMAT,
        "recipe": dataclasses.asdict(recipe),
        "content_hash": content,
        "files": files,
    }
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    for path in tmp.iterdir():
        path.chmod(0o644)
    tmp.chmod(0o755)  # mkdtemp made it 0700


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hf_configs(recipe: ModelRecipe, tokenizer: Any) -> tuple[Any, Any]:
    """The recipe's ``LlamaConfig`` and ``GenerationConfig`` (what config.json and
    generation_config.json hold)."""
    from transformers import GenerationConfig, LlamaConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD, END_OF_TURN)}
    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_context,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[END_OF_TURN]],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    generation = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[END_OF_TURN]], pad_token_id=ids[PAD]
    )
    return config, generation


def _write_weights(recipe: ModelRecipe, tokenizer: Any, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config, generation = hf_configs(recipe, tokenizer)
    if recipe.weights:
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        with torch.no_grad():
            model.lm_head.weight[model_tokenizer.invisible_token_ids(tokenizer)] = 0.0
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:  # a shape for load_format="dummy": bf16, nothing to initialise
        config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    generation.save_pretrained(str(out))


def generate_greedy(
    model_dir: str | Path, prompts: list[str], max_tokens: int
) -> list[dict[str, Any]]:
    """Greedy (temperature 0) completions of `prompts` from an in-process vLLM CPU engine.

    Sets vLLM's environment before importing it (in-process engine, offline hub, 1 GiB KV
    cache unless already set), so call it in a process that has not imported vllm yet, under
    an `if __name__ == "__main__"` guard.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    recipe = (read_stamp(model_dir) or {}).get("recipe", {})
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=recipe.get("max_context"),  # None: the model config's own limit
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {
            "prompt": prompt,
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text,
        }
        for prompt, out in zip(prompts, outputs, strict=True)
    ]
