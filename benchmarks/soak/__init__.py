"""``kvpush bench soak``: load with faults injected on a whole stack; a run that can fail.

The package's modules, each with its own docstring:

- ``run``: the run (references, clients, the fault cycle with its quiesces) and its settings;
- ``stack``: nats-server, the workers (``--prefill`` + ``--decode``), the in-process gateway,
  the faults' signals, idle measurement;
- ``faults``: the killer: which fault next, on which worker; one fault played and timed;
- ``measure``: each fault's detection, recovery and migrations, per kind;
- ``observer``: the soak's own NATS connection (heartbeats, routes, token ids, who served);
- ``client``: one HTTP request read into an ``Answer``;
- ``checks``: the judgement of one answer (token ids, expected errors per fault and stack);
- ``accounting``: counts per category and path, blocks leaked per interval;
- ``report``: the JSON document, its verdict and its markdown tables.

The run fails (exit 1) on a wrong token, an unexpected answer (with a second worker of its
role, a worker's death or stop explains no error at all), a leaked block, a success share
below ``--min-success-share`` (99.9% with two or more workers per role, else 70%), no fault
injected, a kill or stop the gateway noticed later than ``--detect-target``, or no push and
pull answer with received KV checked. This module holds the CLI: ``add_arguments`` and
``main``.

Threading model: one asyncio loop (see ``run``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvpush.benchmarks import docgen
from kvpush.benchmarks.soak import report
from kvpush.benchmarks.soak.checks import FAULTS
from kvpush.benchmarks.soak.run import WORDS, run_soak, settings_from_args

DEFAULT_FAULTS = "kill_prefill,kill_decode,stop_prefill,stop_decode,restart_nats"

__all__ = ["WORDS", "add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--minutes", type=float, default=10.0, help="how long the load and faults run (10)")
    add("--prefill", type=int, default=2, help="prefill workers (2)")
    add("--decode", type=int, default=2, help="decode workers (2)")
    add("--concurrency", type=int, default=4, help="clients at once (4)")
    add("--fault-every", type=float, default=60.0, help="seconds of load between faults (60)")
    add(
        "--faults",
        default=DEFAULT_FAULTS,
        help=f"the killer's fault kinds, comma-separated, of {', '.join(FAULTS)} "
        f"(restart_nats: once per run) ({DEFAULT_FAULTS})",
    )
    add("--recovery", type=float, default=15.0, help="seconds of load after a fault (15)")
    add(
        "--rate-window",
        type=float,
        default=10.0,
        help="seconds of the throughput window a fault's recovery is rated by (10)",
    )
    add(
        "--detect-target",
        type=float,
        default=2.0,
        help="fail when the gateway notices a killed or stopped worker later (2 s)",
    )
    add("--abort-share", type=float, default=0.1, help="requests the client drops (0.1)")
    add("--stream-share", type=float, default=0.2, help="requests streamed to the end (0.2)")
    add("--layer-delay-ms", type=float, default=100.0, help="P's sleep per layer (100)")
    add("--prompts", type=int, default=40, help="size of the prompt pool (40)")
    add("--max-tokens", type=int, default=8, help="tokens per answer (8)")
    add("--seed", type=int, default=0)
    add("--settle-timeout", type=float, default=60.0, help="seconds to wait for idle (60)")
    add(
        "--min-success-share",
        type=float,
        default=None,
        help="fail below this share of token-exact 200s among requests not aborted "
        "(0.999 with two or more workers per role, else 0.7)",
    )
    add("--json", metavar="OUT", help="write the report as JSON")
    add("--doc", metavar="MD", help="rewrite the generated soak block of this document")
    add(
        "--report",
        metavar="IN",
        help="run nothing: judge and render a JSON report written before (exit 1 if it fails)",
    )
    add("--check", action="store_true", help="with --report --doc: only check the doc's table")
    add("--log-dir", default="/tmp/kvpush-soak", help="workers' logs")


def main(args: argparse.Namespace) -> int:
    if args.report:
        result = report.load(Path(args.report))
        judged = report.failures(result)  # the verdict follows the data, not what it says
        if judged != result.failures:
            print(f"[soak] {args.report}: stored verdict differs; judged {judged}", file=sys.stderr)
            return 1
    else:
        try:
            settings = settings_from_args(args)
        except ValueError as exc:
            print(f"[soak] {exc}", file=sys.stderr)
            return 2
        result = asyncio.run(run_soak(settings, Path(args.log_dir)))
        if args.json:
            Path(args.json).write_bytes(report.dump(result))
    table = report.markdown(result)
    published = docgen.publish(table, args.doc, report.SECTION, report.REPORT_COMMAND, args.check)
    for failure in result.failures:
        print(f"[soak] FAIL: {failure}", file=sys.stderr)
    return 1 if published or not result.passed else 0
