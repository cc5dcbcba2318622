"""``kvpush bench soak``: load with faults injected on a whole stack; a run that can fail.

The package's modules, each with its own docstring:

- ``run``: the run (references, clients, the fault cycle with its quiesces);
- ``engines``: the workers' engines per ``--device`` (cpu: the tiny model, one core each; cuda:
  ``--model llama-8b`` with made-up weights, 2 P + 1 D sharing one GPU), the prompts' sizes;
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
pull answer with received KV checked. This module holds the CLI: ``add_arguments``,
``settings_from_args`` (the flags, with their defaults per device) and ``main``; a report goes
to its device's generated section (``report.section_of``: the CPU soak's or the H200's).

Threading model: one asyncio loop (see ``run``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvpush.benchmarks import docgen
from kvpush.benchmarks.soak import engines, report
from kvpush.benchmarks.soak.checks import FAULTS
from kvpush.benchmarks.soak.faults import check_kinds
from kvpush.benchmarks.soak.report import KILLER, SoakSettings
from kvpush.benchmarks.soak.run import WORDS, run_soak

DEFAULT_FAULTS = "kill_prefill,kill_decode,stop_prefill,stop_decode,restart_nats"
REDUNDANT_FLOOR, ALONE_FLOOR = 0.999, 0.7  # --min-success-share's defaults

__all__ = ["WORDS", "add_arguments", "main", "settings_from_args"]


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
    add(
        "--device",
        default=engines.CPU,
        choices=engines.DEVICES,
        help="where the engines run (cpu); cuda: every engine on --gpu, the workers' CUDA "
        "defaults (engine-core process, CUDA graphs)",
    )
    add(
        "--model",
        default="tiny",
        help="a recipe (tiny, bench, llama-8b: built once, weights made up on cuda) or a model "
        "folder (tiny)",
    )
    add("--gpu", type=int, default=0, help="cuda: the GPU every engine shares (0)")
    add(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"cuda: the GPU memory share each engine needs free at its start "
        f"({engines.GPU_SHARE:g}: 2 P + 1 D on one GPU)",
    )
    add(
        "--kv-cache-gib",
        type=float,
        default=None,
        help=f"cuda: each engine's KV cache, fixed: no memory profiling, so engines start "
        f"beside serving ones ({engines.KV_CACHE_GIB:g})",
    )
    add(
        "--layer-delay-ms",
        type=float,
        default=None,
        help="P's sleep per layer (cpu 100, cuda 0: real compute is slow enough)",
    )
    add("--prompts", type=int, default=40, help="size of the prompt pool (40)")
    add(
        "--prompt-tokens",
        type=int,
        default=None,
        help="each prompt of the pool about this many tokens of the soak's words (default: 8 "
        "to 40 words); D's prefix cache holds repeats of a prompt of a block or more (the "
        "`cached` path, no KV moved): give a pool larger than D's cache (--prompts)",
    )
    add("--max-tokens", type=int, default=8, help="tokens per answer (8)")
    add("--seed", type=int, default=0)
    add("--settle-timeout", type=float, default=60.0, help="seconds to wait for idle (60)")
    add(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds a worker's start may take (cpu 240, cuda 540: compile and CUDA graphs)",
    )
    add(
        "--time-budget",
        type=float,
        default=None,
        help="seconds the whole run may take, start to stop: the load ends early enough "
        "(default: none, --minutes of load)",
    )
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


def settings_from_args(args: argparse.Namespace) -> SoakSettings:
    """The run's settings (the device's defaults where a flag is not given); ValueError for a
    fault set the stack cannot play."""
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    check_kinds(kinds, args.prefill, args.decode)
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be 1 or more, not {args.prompt_tokens}")
    floor = args.min_success_share
    if floor is None:  # redundant workers: a worker's death must cost no answer
        floor = REDUNDANT_FLOOR if min(args.prefill, args.decode) >= 2 else ALONE_FLOOR
    device = args.device
    layer_delay = args.layer_delay_ms
    cuda = device == engines.CUDA
    return SoakSettings(
        minutes=args.minutes,
        concurrency=args.concurrency,
        fault_every_s=args.fault_every,
        recovery_s=args.recovery,
        abort_share=args.abort_share,
        stream_share=args.stream_share,
        layer_delay_ms=engines.LAYER_DELAY_MS[device] if layer_delay is None else layer_delay,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        seed=args.seed,
        gateway_max_inflight=2 * args.concurrency,
        burst_clients=3 * args.concurrency,
        settle_timeout_s=args.settle_timeout,
        min_success_share=floor,
        prefill=args.prefill,
        decode=args.decode,
        faults=kinds,
        schedule=KILLER,
        rate_window_s=args.rate_window,
        detect_target_s=args.detect_target,
        device=device,
        model=args.model,
        prompt_tokens=args.prompt_tokens,
        time_budget_s=args.time_budget,
        start_timeout_s=args.start_timeout or engines.START_TIMEOUT_S[device],
        gpu=args.gpu if cuda else None,
        gpu_memory_utilization=(args.gpu_memory_utilization or engines.GPU_SHARE) if cuda else None,
        kv_cache_gib=(args.kv_cache_gib or engines.KV_CACHE_GIB) if cuda else None,
    )


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
    name, command = report.section_of(result, Path(args.report or args.json or "soak.json"))
    published = docgen.publish(table, args.doc, name, command, args.check)
    for failure in result.failures:
        print(f"[soak] FAIL: {failure}", file=sys.stderr)
    return 1 if published or not result.passed else 0
