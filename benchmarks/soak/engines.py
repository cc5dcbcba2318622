"""How the soak's workers run their engines, per device, and the prompts they are given.

``cpu`` (the default): the tiny model (``--model tiny``), every worker on one core of the box in
turn, the workers' CPU defaults (eager engine on a thread), P sleeping ``--layer-delay-ms``
(100) per layer to keep race windows open.

``cuda`` (``--device cuda --model llama-8b``): every engine on one GPU (``--gpu``) with the
workers' CUDA defaults (engine-core process, torch.compile and CUDA graphs: nothing forced
eager), the model's weights made up by vLLM (``load_format`` ``dummy``) for a recipe built
without them, and real compute slow enough that P is not slowed (``--layer-delay-ms`` 0).
Three engines (2 P + 1 D) share the GPU: each starts only with ``gpu_memory_utilization`` of
the GPU's memory free (vLLM's check at start) and gets a fixed KV cache of ``kv_cache_gib``
(vLLM's ``kv_cache_memory_bytes``) instead of vLLM's memory profiling, which counts every
engine's memory on the GPU as its own and so cannot run while another engine starts or
serves: every start (the first ones, a killed worker's restart beside the others serving) is
then safe at any time. An 8B-shaped engine holds about 15 GiB of weights, an 8 GiB KV cache
(64 Ki tokens of 128 KiB: 512 blocks of 128 tokens) and about 4 GiB of activations, graphs and
workspaces: the three take about 81 of the H200's 139 GiB. A killed engine's KV cache may
outlive it while a peer still maps it (CUDA IPC), so a restart needs only 0.25 of the GPU free
(35 GiB): it starts beside the other two even with two dead KV caches still mapped. Each
worker is pinned to an even share of the cores (16 cores, 3 workers: 5 each) and its start
may take minutes (``START_TIMEOUT_S``: a cold torch.compile and the graph capture).

``sized_prompt``: with ``--prompt-tokens N`` a prompt of the pool is about N tokens of the
soak's words (instead of 8 to 40 words). A prompt of a block or more stays in D's prefix
cache, and its repeats then move no KV (the ``cached`` path): the pool should outgrow D's cache
(8 GiB: 32 prompts of 2048 tokens; ``tests/gpu/h200.sh soak`` draws from 120, so about three
in four push and pull requests move KV).

Threading model: none (pure functions; ``resolve`` builds the model on the caller's thread).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvpush.services import models

CPU, CUDA = "cpu", "cuda"
DEVICES: Final = (CPU, CUDA)
LAYER_DELAY_MS: Final = {CPU: 100.0, CUDA: 0.0}  # --layer-delay-ms's default per device
START_TIMEOUT_S: Final = {CPU: 240.0, CUDA: 540.0}  # a worker's start (cuda: compile, graphs)
GPU_SHARE: Final = 0.25  # cuda: the GPU memory each engine needs free at its start
KV_CACHE_GIB: Final = 8.0  # cuda: each engine's KV cache
GIB: Final = 1 << 30


@dataclass(frozen=True)
class Engines:
    """How every worker of one soak runs its engine (module docstring)."""

    device: str
    model_dir: Path
    served_name: str
    load_format: str = "auto"
    gpu: int = 0
    gpu_memory_utilization: float = GPU_SHARE
    kv_cache_gib: float = KV_CACHE_GIB

    @property
    def cuda(self) -> bool:
        return self.device == CUDA

    def flags(self) -> list[str]:
        """The engine flags every worker gets (none on cpu: the workers' CPU defaults)."""
        if not self.cuda:
            return []
        kv_bytes = int(self.kv_cache_gib * GIB)
        return [
            "--device", CUDA, "--gpu", str(self.gpu),
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--load-format", self.load_format,
            f"--engine-arg=--kv-cache-memory-bytes={kv_bytes}",
        ]  # fmt: skip

    def start_batches(self, workers: Sequence[str]) -> list[list[str]]:
        """The workers in the groups they start in, each group once the one before beats: on
        cuda the first alone (it fills the compile caches on a cold host), then the others at
        once (warm); on cpu all at once."""
        if self.cuda and len(workers) > 1:
            return [list(workers[:1]), list(workers[1:])]
        return [list(workers)]


def model_dir_of(spec: str, say: Callable[[str], None]) -> Path:
    """A recipe's folder (``tiny``, ``llama-8b``, ...: built once into the model cache) or the
    folder ``spec`` names."""
    recipe = models.RECIPES.get(spec)
    if recipe is None:
        return Path(spec).expanduser().resolve()
    return models.build_model(recipe, models.default_model_cache_dir() / recipe.name, say)


def resolve(
    device: str,
    model: str,
    say: Callable[[str], None],
    *,
    gpu: int = 0,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: float | None = None,
) -> Engines:
    """The engines of a soak: the model built if it is a recipe, its served name and load format
    read from its stamp (a recipe built without weights: ``dummy``)."""
    model_dir = model_dir_of(model, say)
    recipe = (models.read_stamp(model_dir) or {}).get("recipe") or {}
    return Engines(
        device=device,
        model_dir=model_dir,
        served_name=str(recipe.get("name") or model_dir.name),
        load_format="auto" if recipe.get("weights", True) else "dummy",
        gpu=gpu,
        gpu_memory_utilization=gpu_memory_utilization or GPU_SHARE,
        kv_cache_gib=kv_cache_gib or KV_CACHE_GIB,
    )


def core_sets(cores: Sequence[int], workers: Sequence[str], device: str) -> dict[str, str]:
    """Each worker's ``--cpus``: on cpu one core each, in turn (P then D; wrapping around); on
    cuda an even share of the cores, in slices (the model runs on the GPU, the cores feed it)."""
    if device != CUDA:
        return {w: str(cores[n % len(cores)]) for n, w in enumerate(workers)}
    width = max(1, len(cores) // max(1, len(workers)))
    out = {}
    for n, worker in enumerate(workers):
        mine = sorted({cores[(n * width + k) % len(cores)] for k in range(width)})
        out[worker] = ",".join(map(str, mine))
    return out


def sized_prompt(rng: random.Random, words: Sequence[str], tokens: int, tokenizer: Any) -> str:
    """About ``tokens`` tokens of ``words`` (no more, BOS aside): ``tokens`` words drawn from
    ``rng`` (a word is at least one token), cut after the last whole word that fits.
    ``tokenizer``: a fast Hugging Face tokenizer (character offsets of its tokens)."""
    text = " ".join(rng.choice(words) for _ in range(tokens))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = offsets["offset_mapping"]
    if len(spans) <= tokens:
        return text
    first_over = spans[tokens][0]  # where the first token past the limit starts
    cut = text.rfind(" ", 0, first_over + 1)  # the word it belongs to starts after this space
    return text[:cut].rstrip() if cut > 0 else text[:first_over]


def load_tokenizer(model_dir: Path) -> Any:
    """The model's own tokenizer (what the gateway counts the prompt with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
