"""The ``kvpush bench ...`` command line: its parser and dispatch, one action per benchmark.

``kvpush`` (kvpush.services.cli) hands every argument after ``bench`` to :func:`main` and
imports this package only then, so the runtime never imports the benchmarks. Each action's
work lives in the module it names; those import their heavy parts (vLLM, NIXL) when they run.
Before an action runs, the modules of the ``bench`` extra must be importable
(:data:`EXTRA_MODULES`): a missing one is named in one line, before any engine starts.

Threading model: runs on the caller's (main) thread; actions that serve start their own
asyncio loop or child processes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

# import name -> distribution of what only the benchmarks need (pyproject's `bench` extra)
EXTRA_MODULES: Final = {"PIL": "pillow"}
EXTRA_HINT: Final = "pip install 'kvpush[bench]'"

_SERVE_EPILOG = """\
Examples:
  kvpush bench serve --quick                      smoke run of all five systems (~10 min)
  kvpush bench serve --out-dir docs/benchmarks/serve
  kvpush bench serve --systems kvpush-push,vllm-pull --input-lens 2048 --qps 0.5,1,1.2
  kvpush bench report docs/benchmarks/serve/results.json --out docs/benchmarks/serve.md"""

_SOAK_DOC = """\
kvpush bench soak: its own stack (nats-server, gateway, --prefill N slow prefill workers and
--decode N decode workers, 2 and 2 by default, tiny model), greedy requests in push/pull/local
mode (JSON, streamed, dropped by the client) checked by token ids against references, and a
fault every --fault-every seconds (--faults: kill a random P or D, stop one past its lease,
restart nats-server once per run; a burst past the in-flight bound on request). Each fault's
detection time, recovery to full throughput and moved requests are measured. Before and after
each fault the load pauses and every worker's idle free blocks are recorded: leaks per fault
kind. Every error must be an OpenAI error body that the running fault explains (with redundant
workers, a single worker's death explains none). Exit 1 on a wrong token, an unexpected answer,
a leaked block, a detection past --detect-target, or a success share below
--min-success-share. --report IN renders a JSON report again; --doc MD rewrites its table."""


def missing_extras() -> list[str]:
    """The distributions of the ``bench`` extra whose modules cannot be imported here."""
    found = importlib.util.find_spec
    return [dist for module, dist in EXTRA_MODULES.items() if found(module) is None]


def _runs(module: str) -> Callable[[argparse.Namespace], int]:
    """The action that imports ``kvpush.benchmarks.<module>`` when it runs and calls its main."""

    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(f"kvpush.benchmarks.{module}").main(args) or 0)

    return run


def _action(
    sub: Any,
    name: str,
    help_text: str,
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    func: Callable[[argparse.Namespace], int],
) -> None:
    """One action: its parser (help, raw description), its arguments, its function."""
    parser = sub.add_parser(
        name,
        help=help_text,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=func)


def build_parser(prog: str = "kvpush bench") -> argparse.ArgumentParser:
    from kvpush.benchmarks import checksum, idle, route, serve, soak, transport

    parser = argparse.ArgumentParser(
        prog=prog, description="benchmarks (results go under docs/benchmarks/)"
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    _action(
        sub,
        "transport",
        "NIXL push/pull vs raw WRITE vs memcpy at the bench model's KV sizes",
        transport.__doc__,
        transport.add_arguments,
        _runs("transport"),
    )
    _action(
        sub,
        "idle",
        "CPU a decode engine burns while it waits for KV, per executor mode",
        idle.__doc__,
        idle.add_arguments,
        _runs("idle"),
    )
    _action(
        sub,
        "serve",
        "kvpush push/pull vs vLLM's NixlConnector/NixlPushConnector vs one engine, "
        "over HTTP, QPS sweep",
        (serve.__doc__ or "") + "\n\n" + _SERVE_EPILOG,
        serve.add_arguments,
        _runs("serve.run"),
    )
    _action(
        sub,
        "report",
        "the markdown tables and target verdicts of a `bench serve` results.json",
        serve.REPORT_DOC,
        serve.add_report_arguments,
        _runs("serve.report"),
    )
    _action(
        sub,
        "route",
        "what one routing decision costs: 16 workers, 10k cached prefixes, 1k-8k-token prompts",
        route.__doc__,
        route.add_arguments,
        _runs("route"),
    )
    _action(
        sub,
        "checksum",
        "what the KV checksum of one transfer costs P and D: the 8B shape's KV, 2k and 8k tokens",
        checksum.__doc__,
        checksum.add_arguments,
        _runs("checksum"),
    )
    _action(
        sub,
        "soak",
        "load + random faults for N minutes: 0 wrong tokens, 0 leaks, 0 unexpected errors",
        _SOAK_DOC,
        soak.add_arguments,
        _runs("soak"),
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Parse ``argv`` (what follows ``kvpush bench``) and run its action: its exit status."""
    args = build_parser().parse_args(argv)
    missing = missing_extras()
    if missing:
        print(
            f"kvpush bench: missing {', '.join(missing)} (the bench extra): {EXTRA_HINT}",
            file=sys.stderr,
        )
        return 2
    return int(args.func(args) or 0)
