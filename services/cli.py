"""The ``kvpush`` command line: one entry point, one sub-command per job.

This module owns argument parsing and dispatch only; each command's work lives in the module
it names. Heavy imports (vLLM, torch, transformers) happen inside the command that needs them,
so ``kvpush --help`` and ``kvpush schemas ...`` answer instantly. ``kvpush bench ...`` hands its
arguments to kvpush.benchmarks.cli, imported only then: the runtime never imports the benchmarks.

Threading model: runs on the main thread; commands that serve start their own asyncio loop.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

EPILOG = """\
Quick start:
  kvpush up                         embedded default: nats-server, tiny model, P + D, gateway
  kvpush model tiny --out DIR       build the tiny random-weight test model
  kvpush model llama-8b --out DIR   an 8B-shaped config for GPUs (serve: --load-format dummy)
  kvpush schemas export --check     verify the committed bus contract files are current
Environment: KVPUSH_GIL_SWITCH_US=N sets the GIL switch interval (microseconds; default 500,
CPython's own 5000) of the gateway, the workers and their engines' processes.
See README.md and docs/ for the architecture and operating notes."""


def _cmd_schemas(args: argparse.Namespace) -> int:
    from kvpush.schemas import export

    out = Path(args.out) if args.out else export.PACKAGE_DIR
    if args.check:
        stale = export.stale(out)
        if stale:
            print(f"stale contract files under {out}: {', '.join(stale)}", file=sys.stderr)
            print(
                "run `kvpush schemas export` (or `make schemas`) and commit them", file=sys.stderr
            )
            return 1
        print(f"contract files under {out} are current")
        return 0
    for path in export.write(out):
        print(f"wrote {path}")
    return 0


def _progress(message: str) -> None:
    print(f"[kvpush model] {message}", file=sys.stderr, flush=True)


# the recipe fields a preset's flags override (``--kv-heads`` sets ``kv_heads``)
RECIPE_FLAGS = (
    ("seed", "random seed (default 0)"),
    ("layers", "decoder layers"),
    ("hidden", "hidden size"),
    ("intermediate", "MLP size"),
    ("heads", "attention heads"),
    ("kv_heads", "KV heads (GQA)"),
    ("vocab_size", "BPE vocabulary size"),
    ("max_context", "context length"),
)


def _cmd_model_build(args: argparse.Namespace) -> int:
    import dataclasses

    from kvpush.services import models

    overrides = {
        key: getattr(args, key) for key, _ in RECIPE_FLAGS if getattr(args, key) is not None
    }
    recipe = dataclasses.replace(models.RECIPES[args.preset], **overrides)
    started = time.monotonic()
    path = models.build_model(recipe, Path(args.out), progress=_progress)
    print(f"{recipe.name}: {path} ({time.monotonic() - started:.1f}s)")
    return 0


def _cmd_model_generate(args: argparse.Namespace) -> int:
    from kvpush.services import models

    results = models.generate_greedy(Path(args.model_dir), args.prompt, args.max_tokens)
    if args.json:
        print(json.dumps(results))
    else:
        for item in results:
            print(f"{item['prompt']!r} -> {item['text']!r}")
    return 0


def _cmd_nats(args: argparse.Namespace) -> int:
    from kvpush.services.natsd import EmbeddedNats

    server = EmbeddedNats(host=args.host, port=args.port)
    print(f"nats-server listening on {server.start()} (Ctrl-C stops it)", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """``kvpush bench ...``: the only place the runtime imports kvpush.benchmarks, here, when
    ``bench`` is the command (tests/unit/test_import_graph.py holds it to this function)."""
    try:
        from kvpush.benchmarks import cli as bench_cli
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("kvpush.benchmarks"):
            raise
        print(
            "kvpush bench: the benchmarks (kvpush.benchmarks, benchmarks/ of the source tree) "
            "are not installed: pip install -e '.[bench]' from a checkout",
            file=sys.stderr,
        )
        return 2
    return bench_cli.main(args.bench_argv)


def _main_of(module: str) -> Callable[[argparse.Namespace], int]:
    """A command that runs ``module.main(args)``, importing ``module`` only then."""
    return lambda args: importlib.import_module(module).main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush",
        description="kvpush: prefill/decode-disaggregated LLM serving where prefill pushes KV "
        "(NIXL WRITE) into blocks the decode engine announced over NATS.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    schemas = sub.add_parser("schemas", help="the public bus contract (JSON Schema, AsyncAPI)")
    schemas_sub = schemas.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = schemas_sub.add_parser(
        "export", help="write schemas/json/*.json and schemas/asyncapi.json from the structs"
    )
    export.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files differ from the structs",
    )
    export.add_argument("--out", metavar="DIR", help="target folder (default: the package's)")
    export.set_defaults(func=_cmd_schemas)

    model = sub.add_parser("model", help="build local random-weight models; run one in vLLM")
    model_sub = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    for preset, text in (
        ("tiny", "tiny Llama for tests (2 layers, hidden 128): seconds to build"),
        ("bench", "larger Llama for benchmarks (8 layers, hidden 512): prefill costs real time"),
        (
            "llama-8b",
            "Llama-3-8B shape for GPU benchmarks (32 layers, hidden 4096, 8 KV heads): config"
            " and tokenizer only, serve it with --load-format dummy (random bf16 weights)",
        ),
        ("llama-70b", "Llama-3-70B shape (80 layers, hidden 8192), like llama-8b: for the record"),
    ):
        p = model_sub.add_parser(preset, help=text, description=text + ". Same seed, same files.")
        p.add_argument("--out", required=True, metavar="DIR", help="model folder to write")
        for key, text in RECIPE_FLAGS:
            p.add_argument("--" + key.replace("_", "-"), type=int, help=text)
        p.set_defaults(func=_cmd_model_build, preset=preset)
    gen = model_sub.add_parser("generate", help="greedy generation with vLLM (CPU, in-process)")
    gen.add_argument("model_dir", metavar="DIR")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--json", action="store_true", help="print results as JSON")
    gen.set_defaults(func=_cmd_model_generate)

    natsd = sub.add_parser("nats", help="run an embedded nats-server (JetStream) in the foreground")
    natsd.add_argument("--host", default="127.0.0.1")
    natsd.add_argument("--port", type=int, default=4222, help="-1 picks a free port")
    natsd.set_defaults(func=_cmd_nats)

    # everything after `bench` goes to kvpush.benchmarks.cli unparsed (its own --help included)
    bench_help = "benchmarks (results go under docs/benchmarks/; kvpush bench --help lists them)"
    bench = sub.add_parser("bench", help=bench_help, add_help=False, prefix_chars="\0")
    bench.add_argument("bench_argv", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)

    from kvpush.services import up, up_config
    from kvpush.services.gateway import app as gateway_app
    from kvpush.services.gateway import config as gateway_config
    from kvpush.services.telemetry import ttft
    from kvpush.services.workers import config as worker_config

    for name, module, add_arguments, text in (
        (
            "up",
            up,
            up_config.add_arguments,
            "embedded default stack: nats-server, tiny model, prefill + decode, gateway",
        ),
        ("gateway", gateway_app, gateway_config.add_arguments, "OpenAI-compatible HTTP gateway"),
    ):
        command = sub.add_parser(
            name,
            help=text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_arguments(command)
        command.set_defaults(func=module.main)
    ttft.add_parser(sub)
    for role, text in (
        ("prefill", "prefill worker: computes prompts, pushes their KV"),
        ("decode", "decode worker: receives KV, streams tokens to the gateway"),
    ):
        worker = sub.add_parser(
            role,
            help=text,
            description=text + ". Flags override the "
            "KVPUSH_* environment variables named in their help.",
        )
        worker_config.add_arguments(worker)
        worker.set_defaults(func=_main_of(f"kvpush.services.workers.{role}"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvpush.services.settings import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:  # an unusable flag or variable: one line, exit status 2
        print(f"kvpush: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
