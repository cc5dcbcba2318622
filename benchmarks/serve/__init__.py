"""kvpush bench serve: kvpush push/pull against vLLM's own connectors and one vLLM engine.

Starts each system in turn on this machine with the same model (default: the bench model from
`kvpush model bench`, built if missing), the same cores (prefill core 0, decode core 1; the
aggregated engine on core 0) and the same request trace, and drives it over HTTP
(/v1/completions, streamed, token-id prompts, ignore_eos):

  kvpush-push   kvpush up --mode push (P WRITEs KV into blocks D announced)
  kvpush-pull   kvpush up --mode pull (D READs P's blocks after prefill)
  vllm-pull     two vLLM OpenAI servers with NixlConnector and a sequential proxy
  vllm-push     two vLLM OpenAI servers with NixlPushConnector, both legs sent at once
  aggregated    one vLLM OpenAI server, no disaggregation (on cuda: vllm-serve, its defaults)

Tables (--tables): one per dataset and input length, e.g. random:2048 or sonnet:2048; every
system runs every point of every table in one invocation. Load: Poisson arrivals at a QPS
sweep (default: fractions of the prefill capacity, probed once per input length and reused for
every system and repeat) and fixed concurrency. Prompts and arrivals are seeded from (dataset,
input length, point, repeat): the same for every system, new for every repeat (no prefix-cache
hits across repeats). --repeats N runs everything N times, interleaved (repeat 1 of every
system, then repeat 2, ...); reports give the median and [min-max] of each figure.

Every point of a disaggregated system is checked for requests served without a KV transfer,
and fails (marked in the tables; exit status 1) when it has any: kvpush: the gateway's
kvpush_gateway_kv_outcomes and kvpush_gateway_routed_requests counters (requests ask for the
mode explicitly, so the gateway can never fall back to local mode silently); vllm-pull and
vllm-push: the proxy's no_kv_params count and D's cached prompt tokens (usage.
prompt_tokens_details), which show a prompt D computed itself. Aggregated: n/a.

Per point: TTFT mean/P50/P99, TPOT, ITL, throughput, errors, the transfer check and kvpush's
TTFT breakdown. Writes results.json, results.md (what `kvpush bench report` generates) and
TTFT-vs-QPS plots into --out-dir.
(Code: plan.py, systems.py, vllm_systems.py, loadgen.py, checks.py, run.py, results.py,
summary.py, report.py, plot.py; this __init__ holds only the command lines, imported by
`kvpush bench --help` (kvpush.benchmarks.cli).)
"""

from __future__ import annotations

import argparse

CPU_SYSTEMS = ("kvpush-push", "kvpush-pull", "vllm-pull", "vllm-push", "aggregated")
# GPU: every engine on the flags its users give it (vLLM's defaults: CUDA graphs, async
# scheduling); vllm-serve is the aggregated engine as `vllm serve` runs it; vllm-pull-tuned
# is vLLM's pull with its READ on cuda_ipc (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on)
GPU_SYSTEMS = ("kvpush-push", "kvpush-pull", "vllm-pull-tuned", "vllm-push", "vllm-serve")
# extra rows: the same with --enforce-eager, named so (never in the defaults)
EAGER_SYSTEMS = tuple(f"{name}-eager" for name in (*GPU_SYSTEMS, "vllm-pull"))
ALL_SYSTEMS = (
    "kvpush-push",
    "kvpush-pull",
    "vllm-pull",
    "vllm-pull-tuned",
    "vllm-push",
    "vllm-serve",
    "aggregated",
    *EAGER_SYSTEMS,
    "kvpush-push-mps",  # an extra row: kvpush up --mps on (GPU)
    "kvpush-push-unchecked",  # an extra row: --kv-checksum off (what the check costs)
)
CAPACITY_FRACTIONS = (0.25, 0.5, 0.75, 0.9, 1.05)
DEFAULT_TABLES = "random:512,random:1024,random:2048,sonnet:2048"
VLLM_CLIENT_TABLES = "random:2048,random:8192,prefix:2048"  # the default with --client vllm


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _capacities(text: str) -> dict[int, float]:
    found = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        length, sep, req_s = item.partition("=")
        if not sep or not length.isdigit() or float(req_s) <= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: want LEN=REQ_S, e.g. 2048=19")
        found[int(length)] = float(req_s)
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--systems",
        default=None,
        help="comma list (default on cuda: kvpush-push, kvpush-pull, vllm-pull-tuned, vllm-push,"
        " vllm-serve, each on its users' default engine flags; NAME-eager adds --enforce-eager;"
        " on cpu: kvpush-push, kvpush-pull, vllm-pull, vllm-push, aggregated)",
    )
    add(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="cpu or cuda for every engine (default auto: the installed vLLM's); on cuda the"
        " engines of one system share --gpu and start one after the other",
    )
    add("--gpu", default=0, type=int, help="cuda: the GPU every system runs on (default 0)")
    add(
        "--gpu-memory-utilization",
        default=0.4,
        type=float,
        help="cuda: each engine's share of the GPU (default 0.4: P and D side by side; the"
        " aggregated engine gets twice that, the GPU share of the two)",
    )
    add(
        "--decode-gpu-memory-utilization",
        default=None,
        type=float,
        help="cuda: kvpush's decode engines' share of the GPU instead (kvpush up's"
        " --decode-gpu-memory-utilization; default: --gpu-memory-utilization's). A D holds every"
        " running answer's KV, a P a prompt's until it is pushed: where P and D share one GPU,"
        " D's share is what a one-engine peer's KV is weighed against",
    )
    add(
        "--load-format",
        default=None,
        help="vLLM load format of every engine (default: dummy for a model built without weights,"
        " e.g. `kvpush model llama-8b`, else auto)",
    )
    add("--model", default="bench", help="model folder, or 'bench' / 'tiny' (built if missing)")
    add(
        "--tables",
        default=None,
        metavar="DATASET:LEN,...",
        help=f"the tables to measure (default {DEFAULT_TABLES}; --client vllm:"
        f" {VLLM_CLIENT_TABLES}); DATASET is random, sonnet"
        " (--client kvpush) or, with --client vllm, prefix (half of each prompt shared),"
        " reuse50 / reuse90 (vLLM's prefix-repetition dataset) or chat (multi-turn"
        " conversations sharing a system prompt)",
    )
    add(
        "--input-lens",
        default=None,
        type=_ints,
        help="instead of --tables: prompt lengths (tokens), crossed with --datasets "
        "(default 512,1024,2048)",
    )
    add(
        "--datasets",
        default=None,
        help="instead of --tables: random and/or sonnet (comma list, default random)",
    )
    add("--output-len", default=32, type=int, help="output tokens per request (ignore_eos)")
    add(
        "--qps",
        default="auto",
        help="Poisson rates, comma list, or 'auto': "
        + ", ".join(f"{f:g}" for f in CAPACITY_FRACTIONS)
        + " x the prefill capacity probed once per input length (default auto)",
    )
    add(
        "--fractions",
        default=None,
        type=_floats,
        help="with --qps auto: the fractions of the probed prefill capacity (default "
        + ",".join(f"{f:g}" for f in CAPACITY_FRACTIONS)
        + ")",
    )
    add(
        "--capacity",
        default=None,
        type=_capacities,
        metavar="LEN=REQ_S,...",
        help="with --qps auto: the prefill capacity per input length, given instead of probed"
        " (e.g. 2048=19,8192=4.6): runs in parts then get the same rates, and --join can join"
        " them",
    )
    add("--concurrency", default=[1, 4], type=_ints, help="fixed-concurrency points (1,4)")
    add("--duration", default=40.0, type=float, help="seconds of arrivals per QPS point (40)")
    add("--min-requests", default=12, type=int, help="at least this many per point (12)")
    add(
        "--repeats",
        default=None,
        type=int,
        help="run every point this many times, interleaved across systems (default 3; --quick: 1)",
    )
    add(
        "--quick",
        action="store_true",
        help="smoke run: random 512 only, qps 1, c=2, 8 requests per point",
    )
    add(
        "--time-budget",
        default=None,
        type=float,
        metavar="SECONDS",
        help="start no system when the run so far plus its longest system would pass SECONDS:"
        " save, exit 3, and go on later with --resume (runs in parts, e.g. on a lent machine)",
    )
    add(
        "--restart",
        action="store_true",
        help="after each system's run, start it once more on the same host and record the"
        " seconds to serving (restart_s: compile caches warm; issue 29's restart target)",
    )
    add(
        "--client",
        default=None,
        choices=("kvpush", "vllm"),
        help="who sends each point's load: vllm (`vllm bench serve`, vLLM's own client: random,"
        " prefix, reuse and chat tables) or kvpush (its load generator: random and sonnet"
        " tables, token-id prompts) (default: vllm on cuda, kvpush on cpu)",
    )
    add("--out-dir", default="bench-results/serve", help="results.json/.md and plots go here")
    add(
        "--resume",
        action="store_true",
        help="continue the interrupted run in OUT_DIR (its results.partial.json, saved after "
        "every system of every repeat): same arguments and commit, or it refuses",
    )
    add(
        "--join",
        nargs="+",
        metavar="RESULTS.json",
        default=None,
        help="run nothing: join the results of runs in parts (the same plan and given "
        "--capacity, other systems; a system in several parts: the last part's points; a part "
        "cut short: its results.partial.json) into OUT_DIR/results.json, .md and plots",
    )
    add("--log-dir", default=None, help="systems' logs (default OUT_DIR/logs)")
    add("--json", metavar="OUT", help="also write the JSON document here")
    add(
        "--trace",
        action="store_true",
        help="kvpush systems also write spans (OUT_DIR/traces/<system>-r<repeat>.jsonl): for "
        "`kvpush ttft`, and to measure what tracing costs (compare with a run without)",
    )


REPORT_DOC = """\
kvpush bench report: the tables of a `kvpush bench serve` run, generated from its results.json.

Per table (dataset, input length): every point x every system with TTFT mean/P50/P99, TPOT
and throughput as the median and [min-max] over the repeats, errors and the transfer check
(failed points are marked); the ratios other / kvpush-push (of the medians); kvpush's TTFT
breakdown per point; and the verdicts of the targets (met / missed, from the medians, with
every point listed).

Without --out the generated part is printed. With --out DOC it goes into DOC between the
markers `<!-- generated by kvpush bench report from RESULTS: do not edit -->` and
`<!-- end generated -->` (added at the end of DOC the first time); everything outside the
markers is left as it is. --check writes nothing and exits 1 when DOC's generated part is not
what RESULTS generates."""


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("results", metavar="RESULTS.json", help="the results.json of a `kvpush bench serve` run")
    add("--out", metavar="DOC", help="markdown file whose generated part is written / checked")
    add("--check", action="store_true", help="with --out: exit 1 if DOC is not current")
    add("--plots", action="store_true", help="also (re)write the PNG plots next to RESULTS")
