"""``kvpush bench report``: the markdown tables and plots of a ``kvpush bench serve`` run.

``render`` turns a results document into markdown (``summary.py`` computes what it shows):
the run's parameters, the target verdicts, and per table (dataset, input length) every point x
every system (TTFT mean/P50/P99, TPOT mean, throughput: median and [min-max] over repeats;
errors; the transfer check, failures marked and explained), the ratios other / kvpush-push of
the medians, and kvpush's TTFT breakdown. Nothing in it depends on the time it is generated.

A document (e.g. ``docs/benchmarks/serve.md``) holds the generated part as its ``serve``
section (``kvpush.benchmarks.docgen`` markers, which name the command that regenerates
it); ``write_doc`` replaces that part (or appends it the first time) and leaves the prose
around it alone; ``check_doc`` says whether the part is what the results generate. ``plots``
writes one PNG per table (medians over repeats).

Threading model: pure functions, plus file reads and writes in ``write_doc``/``check_doc``/
``plots``/``main``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import results as results_mod
from kvpush.benchmarks.serve import summary, summary_engines
from kvpush.benchmarks.serve.plot import ttft_chart
from kvpush.benchmarks.serve.results import GIVEN, Document
from kvpush.benchmarks.serve.summary import REFERENCE, Row, Spread
from kvpush.services.telemetry.breakdown import PART_NAMES

SECTION = "serve"  # the generated section's name in a document (docgen markers)


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _cell(value: Spread | None) -> str:
    if value is None:
        return "—"
    if value.n == 1 or value.lo == value.hi:
        return _num(value.median)
    return f"{_num(value.median)} [{_num(value.lo)}–{_num(value.hi)}]"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _point_label(row: Row | summary.Ratio | summary.VerdictPoint) -> str:
    if row.capacity_fraction is not None:
        return f"{row.label} ({row.capacity_fraction:g}x)"
    return row.label


def _check_cell(row: Row) -> str:
    c = row.check
    if not c.applies:
        return "n/a"
    if c.ok:
        return f"ok ({c.checked})"
    if c.failed_repeats:
        return f"**FAILED** ({c.without_transfer} of {c.checked})"
    return "**not checked**"


def _meta_lines(document: Document) -> list[str]:
    meta = document.meta
    model = meta.get("model") or {}
    shape = ", ".join(
        f"{k} {model[k]}" for k in ("layers", "hidden", "kv_heads") if model.get(k) is not None
    )
    lines = [
        f"Run of {meta.get('date', '?')} at kvpush {meta.get('kvpush_rev', '?')}: vLLM "
        f"{meta.get('vllm', '?')}, nixl {meta.get('nixl', '?')}"
        + (f", on {meta['gpu']}" if meta.get("gpu") else "")
        + ", model "
        f"{model.get('name', '?')}" + (f" ({shape})" if shape else "") + f", "
        f"{meta.get('output_len', '?')} output tokens, {meta.get('repeats', 1)} repeat(s), "
        f"{meta.get('duration_s', '?')} s of arrivals per QPS point.",
        "",
    ]
    parts = meta.get("parts") or []
    if len(parts) > 1:  # joined with --join
        lines += [f"Joined from {len(parts)} runs in parts (`kvpush bench serve --join`):", ""]
        for n, part in enumerate(parts, 1):
            planned, ran = part.get("systems") or [], part.get("ran", part.get("systems")) or []
            cut = [s for s in planned if s not in ran]
            systems = ", ".join(ran) + (f" (cut short before {', '.join(cut)})" if cut else "")
            share = part.get("gpu_memory_utilization")  # kept where the parts' shares differ
            if share is not None:
                systems += f" (--gpu-memory-utilization {share:g})"
            if "kvpush_env" in part:  # kept where the parts' KVPUSH_* settings differ
                systems += f" ({results_mod.part_environment_text(part['kvpush_env'])})"
            lines.append(
                f"{n}. {part.get('date', '?')} at {part.get('kvpush_rev', '?')}, ran {systems}: "
                f"`kvpush {' '.join(part.get('argv') or [])}`"
            )
        lines.append("")
    else:
        lines += [f"Command: `kvpush {' '.join(meta.get('argv') or [])}`", ""]
    if env := results_mod.environment_text(meta.get("kvpush_env")):
        lines += [f"kvpush's settings from the environment: {env}.", ""]
    if document.capacity:
        given = {c.probed_on for c in document.capacity.values()} == {GIVEN}
        values = "; ".join(
            f"{n} tokens: {c.req_s:.2f} req/s" + ("" if given else f" (on {c.probed_on})")
            for n, c in sorted(document.capacity.items(), key=lambda kv: int(kv[0]))
        )
        how = (
            "given with --capacity (the QPS points are fractions of it, the same for every "
            "system and part)"
            if given
            else "probed once per input length (1 / median TTFT of 3 one-token requests in a "
            "row) and used for every system and repeat"
        )
        lines += [f"Prefill capacity, {how}: {values}.", ""]
    lines += [
        "Figures are the median over the repeats with [min–max]; times in ms. KV check: "
        "requests verified to have been served with a KV transfer (n/a: one engine).",
        "",
    ]
    return lines


def _verdict_lines(verdicts: list[summary.Verdict]) -> list[str]:
    lines = [
        "### Targets",
        "",
        "| target | scope | ratio | verdict | points met |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        lines.append(
            f"| {v.key}: {v.text} | {v.scope} | {v.ratio} | **{v.verdict}** "
            f"| {v.met_count} of {len(v.points)} |"
        )
    lines += ["", "Per point (the ratio of the medians; misses in bold):", ""]
    for v in verdicts:
        items = []
        for p in v.points:
            value = _ratio(p.value) + (f" ({p.why})" if p.why else "")
            table = f"{p.dataset} {p.input_len} " if p.input_len else ""  # not a start point
            text = f"{table}{_point_label(p)}: {value}"
            items.append(text if p.met else f"**{text}**")
        lines.append(f"- {v.key}: " + ("; ".join(items) if items else "no point in scope"))
    lines.append("")
    return lines


def _table_lines(
    dataset: str, input_len: int, rows: list[Row], prefix: str, repeats: int
) -> list[str]:
    lines = [
        f"### {dataset}, {input_len} input tokens",
        "",
        f"![TTFT vs QPS, {dataset} {input_len}]({prefix}ttft-{dataset}-{input_len}.png)",
        "",
        "| point | system | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | req/s | done/err "
        "| KV check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    for r in rows:
        f = r.figures
        name = r.system if r.check.ok else f"**{r.system}**"
        if r.runs < repeats:  # a repeat of this system failed before the point
            name += f" ({r.runs} of {repeats} runs)"
        lines.append(
            f"| {_point_label(r)} | {name} | {_cell(f.get('ttft_mean'))} "
            f"| {_cell(f.get('ttft_p50'))} | {_cell(f.get('ttft_p99'))} "
            f"| {_cell(f.get('tpot_mean'))} | {_cell(f.get('req_s'))} "
            f"| {r.completed}/{r.errors} | {_check_cell(r)} |"
        )
        for detail in r.check.details:
            failures.append(f"- {r.system}, {r.label}, {detail}")
        if r.check.unchecked_repeats:
            runs = ", ".join(f"r{n}" for n in r.check.unchecked_repeats)
            failures.append(f"- {r.system}, {r.label}: no check recorded ({runs})")
    lines.append("")
    if failures:
        lines += ["Failed transfer checks (r = repeat):", "", *failures, ""]
    return lines


def _ratio_lines(ratios: list[summary.Ratio]) -> list[str]:
    if not ratios:
        return []
    lines = [
        f"Ratios other / {REFERENCE} of the medians (above 1: {REFERENCE} is better; "
        "†: a transfer check failed at this point):",
        "",
        "| point | vs | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean |",
        "|---|---|---|---|---|---|",
    ]
    for r in ratios:
        mark = "" if r.checks_ok else " †"
        cells = " | ".join(_ratio(r.values.get(f)) for f in summary.RATIO_FIGURES)
        lines.append(f"| {_point_label(r)} | {r.vs}{mark} | {cells} |")
    return [*lines, ""]


def _breakdown_lines(rows: list[Row]) -> list[str]:
    parts = [r for r in rows if r.breakdown]
    if not parts:
        return []
    lines = [
        "kvpush TTFT breakdown: P50 of each part (ms, median over repeats; from the "
        "gateway's per-request timing):",
        "",
        "| point | system | " + " | ".join(PART_NAMES) + " |",
        "|---|---|" + "---|" * len(PART_NAMES),
    ]
    for r in parts:
        assert r.breakdown is not None
        cells = " | ".join(_num(r.breakdown.get(n)) for n in PART_NAMES)
        held = f" (ring held {r.breakdown_partial})" if r.breakdown_partial else ""
        lines.append(f"| {_point_label(r)} | {r.system}{held} | {cells} |")
    return [*lines, ""]


def render(document: Document, plots_prefix: str = "") -> str:
    """The generated markdown (no markers); ``plots_prefix``: path from it to the PNGs."""
    all_rows = summary.rows(document)
    ratios = summary.ratios(all_rows)
    lines = ["## Results (generated)", "", *_meta_lines(document)]
    lines += _verdict_lines(summary_engines.verdicts_of(document, all_rows))
    if summary_engines.applies(document):
        lines += _start_lines(document)
    for dataset, input_len in summary.tables(document):
        rows = [r for r in all_rows if r.table == (dataset, input_len)]
        repeats = int(document.meta.get("repeats") or 1)
        lines += _table_lines(dataset, input_len, rows, plots_prefix, repeats)
        lines += _ratio_lines(
            [r for r in ratios if (r.dataset, r.input_len) == (dataset, input_len)]
        )
        lines += _breakdown_lines(rows)
    lines += failed_lines(document)
    return "\n".join(lines)


def _start_lines(document: Document) -> list[str]:
    """Each system's start to ready (E9, E10): the slowest start and the fastest restart."""
    lines = ["Start to ready, seconds (cold: the system's slowest start, its first on a host;"]
    lines += ["restart: its fastest start on a host it started on before):", ""]
    lines += ["| system | cold | restart |", "|---|---|---|"]
    for name, cold, warm in summary_engines.start_rows(document):
        lines.append(f"| {name} | {cold:.1f} | {'—' if warm is None else f'{warm:.1f}'} |")
    return [*lines, ""]


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def command(results_path: Path, doc_path: Path) -> str:
    """The command that regenerates ``doc_path``'s section (named in its marker)."""
    results, doc = (_relative(p, Path.cwd()) for p in (results_path, doc_path))
    return f"kvpush bench report {results} --out {doc}"


def write_doc(doc_path: Path, results_path: Path, check: bool = False) -> bool:
    """Write the generated part into ``doc_path`` (links to the plots relative to it); True if
    the file changed. ``check``: write nothing, raise ``docgen.DocOutOfDate`` if it differs."""
    folder = _relative(results_path.parent, doc_path.parent)
    body = render(results_mod.load(results_path), "" if folder == "." else folder + "/")
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    return docgen.update(doc_path, SECTION, body, command(results_path, doc_path), check)


def check_doc(doc_path: Path, results_path: Path) -> str | None:
    """None when ``doc_path``'s generated part is what ``results_path`` generates, else why."""
    if not doc_path.exists():
        return f"{doc_path} does not exist"
    try:
        write_doc(doc_path, results_path, check=True)
    except docgen.DocOutOfDate as exc:
        return str(exc)
    return None


def plots(document: Document, out_dir: Path) -> list[Path]:
    """One TTFT P50/P99-vs-QPS chart per table (medians over repeats)."""
    written = []
    all_rows = summary.rows(document)
    for dataset, input_len in summary.tables(document):
        p50: dict[str, list[tuple[float, float]]] = {}
        p99: dict[str, list[tuple[float, float]]] = {}
        for r in all_rows:
            if r.table != (dataset, input_len) or r.load_kind != "qps":
                continue
            if "ttft_p50" in r.figures and "ttft_p99" in r.figures:
                p50.setdefault(r.system, []).append((r.load, r.figures["ttft_p50"].median))
                p99.setdefault(r.system, []).append((r.load, r.figures["ttft_p99"].median))
        if not p50:
            continue
        title = f"TTFT vs QPS: {dataset} prompts of {input_len} tokens (median over repeats)"
        path = out_dir / f"ttft-{dataset}-{input_len}.png"
        written.append(ttft_chart(path, title, p50, p99))
    return written


def main(args: argparse.Namespace) -> int:
    """``kvpush bench report RESULTS [--out DOC] [--check] [--plots]``."""
    results_path = Path(args.results)
    if args.check:
        if not args.out:
            print("kvpush bench report: --check needs --out DOC", file=sys.stderr)
            return 2
        problem = check_doc(Path(args.out), results_path)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"{args.out} is current with {args.results}")
        return 0
    document = results_mod.load(results_path)
    if args.plots:
        for path in plots(document, results_path.parent):
            print(f"wrote {path}", file=sys.stderr)
    if args.out:
        changed = write_doc(Path(args.out), results_path)
        print(f"{'wrote' if changed else 'unchanged:'} {args.out}", file=sys.stderr)
    else:
        print(render(document))
    return 0


def failed_lines(document: Document) -> list[str]:
    """The systems of ``document`` that failed to run, with the first line of each error."""
    failed = {n: s for n, s in document.systems.items() if isinstance(s, dict) and not s.get("ok")}
    if not failed:
        return []
    lines = ["Systems that failed to run:", ""]
    for name, info in failed.items():
        lines.append(f"- {name}: {str(info.get('error', '?')).splitlines()[0][:200]}")
    return [*lines, ""]
