"""``kvpush ttft``: where each traced request's time to first token went.

This module owns the ``ttft`` sub-command: its arguments and exit status, reading
``--trace-file`` JSON lines and writing the table, the summary and the ``--json`` report. The
report itself (model, percentiles, text) is ``ttft_report``'s, the breakdown ``breakdown``'s,
the PNG ``waterfall``'s, and the OTLP/HTTP receiver of ``--listen`` ``ttft_listen``'s.

Threading model: file mode is plain synchronous code on the caller's thread; ``--listen`` runs
one asyncio loop on that same thread (see ``ttft_listen``). Only the standard library (and
``ttft_report``, which imports no more) is imported at module level, so registering the command
keeps ``kvpush --help`` instant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.services.telemetry.ttft_report import (
    Report,
    UsageError,
    analyze,
    format_summary,
    table_header,
    table_row,
)

if TYPE_CHECKING:
    from kvpush.schemas.spans import SpanRecord

DESCRIPTION = """\
The TTFT breakdown of traced requests: for each request, its time to first token (gateway
arrival -> first byte written) split into consecutive parts that add up to it exactly:

  gateway          arrival -> RequestEvent published (parse, tokenize, route)
  queue at P       published -> P starts the prompt's forward (bus, P's engine queue)
  prefill compute  P's forward of the prompt
  push tail        KV transfer time not hidden behind compute (pull mode: D's READ)
  D wait           last KV write -> D knows the KV is there
  D first step     D's first engine step (mode local: D's own prefill)
  streaming        first token -> first byte written by the gateway

Reads the JSON-lines span files written with --trace-file, or receives spans live as OTLP/HTTP
protobuf with --listen. Prints one row per request and a summary: mean, p50 and p99 of the TTFT
and of each part (percentiles by linear interpolation between closest ranks, as numpy's
default; the p50s of the parts do not add up to the p50 TTFT, the means do)."""

EPILOG = """\
examples:
  kvpush up --trace-file t.jsonl            serve, appending every span to t.jsonl
  ... send some requests ...
  kvpush ttft t.jsonl --png w.png           table, summary and a waterfall PNG
  kvpush ttft t.jsonl --last 0 --json r.json
  kvpush ttft --listen 127.0.0.1:4318 --save t.jsonl
      with OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 set for the services; a
      request's row is printed about a second after its first byte; Ctrl-C prints the summary

exit status: 0 ok, 1 no complete request found, 2 usage error"""


def _read_files(paths: Sequence[str]) -> Iterator[SpanRecord]:
    from kvpush.services.telemetry.spans import read_jsonl

    for path in paths:
        count = 0
        try:
            for record in read_jsonl(path):
                count += 1
                yield record
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not count:
            print(f"kvpush ttft: note: {path} holds no span records", file=sys.stderr)


def _check_args(args: argparse.Namespace) -> None:
    if bool(args.files) == bool(args.listen):
        raise UsageError("give span FILEs or --listen HOST:PORT (one of the two)")
    if args.listen is None and (args.save or args.duration is not None):
        raise UsageError("--save and --duration go with --listen")
    if args.last < 0:
        raise UsageError("--last must be 0 or more")
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be more than 0 seconds")
    if args.grace < 0:
        raise UsageError("--grace must be 0 or more")
    for path in args.files:
        if not Path(path).exists():
            raise UsageError(f"no such file: {path}")
        if Path(path).is_dir():
            raise UsageError(f"{path} is a folder, not a span file")
    for flag, path in (("--json", args.json), ("--png", args.png), ("--save", args.save)):
        if path is None:
            continue
        if Path(path).is_dir():
            raise UsageError(f"{flag} {path}: is a folder")
        if not Path(path).absolute().parent.is_dir():
            raise UsageError(f"{flag} {path}: no such folder {Path(path).absolute().parent}")
    if args.png and importlib.util.find_spec("PIL") is None:
        raise UsageError("--png needs Pillow, in the bench extra: pip install 'kvpush[bench]'")


def _write_outputs(report: Report, args: argparse.Namespace) -> None:
    try:
        if args.json:
            Path(args.json).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
            print(f"wrote {args.json}")
        if args.png and report.breakdowns:
            from kvpush.services.telemetry import waterfall

            waterfall.write_png(report.breakdowns, args.png)
            print(f"wrote {args.png}")
        elif args.png:
            print(f"no complete request: {args.png} not written")
    except OSError as exc:
        raise UsageError(f"cannot write: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """The command (``func`` of the ``ttft`` parser): 0 ok, 1 no complete request, 2 usage."""
    try:
        _check_args(args)
        if args.listen:
            from kvpush.services.telemetry import ttft_listen

            report = ttft_listen.run_listen(args)
            shown = len(report.breakdowns)
        else:
            report = analyze(_read_files(args.files))
            rows = report.breakdowns[-args.last :] if args.last else report.breakdowns
            if rows:
                print(table_header())
                print("\n".join(table_row(b) for b in rows), end="\n\n")
            shown = len(rows)
        print(format_summary(report, shown), flush=True)
        _write_outputs(report, args)
    except UsageError as exc:
        print(f"kvpush ttft: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvpush ttft t.jsonl | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0 if report.breakdowns else 1


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Adds ``ttft`` to ``subparsers`` (its ``func`` default is ``run``)."""
    parser = subparsers.add_parser(
        "ttft",
        help="TTFT breakdown of traced requests (span files or live OTLP), waterfall PNG",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)
    parser.add_argument(
        "files", nargs="*", metavar="FILE", help="span JSON-lines files (--trace-file)"
    )
    parser.add_argument(
        "--last",
        type=int,
        default=20,
        metavar="N",
        help="print the N most recent requests' rows (default 20, 0: all); "
        "the summary covers every request",
    )
    parser.add_argument(
        "--json", metavar="OUT", help="write every breakdown and the summary as JSON"
    )
    parser.add_argument("--png", metavar="OUT", help="write a waterfall PNG (the last 40 requests)")
    listen = parser.add_argument_group("live")
    listen.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="receive OTLP/HTTP protobuf on POST /v1/traces instead of reading "
        "files (port 0 picks a free one); Ctrl-C or SIGTERM ends it",
    )
    listen.add_argument(
        "--save", metavar="FILE", help="also append the received spans to FILE as JSON lines"
    )
    listen.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    listen.add_argument(
        "--grace",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds to wait after a trace has its root and first byte before "
        "printing its row, so that late spans of P and D join (default 1; kvpush services "
        "export every 0.5 s). The summary uses every span received, late ones too",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpush ttft`` on its own (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["ttft", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
