"""``kvpush bench``: the runtime's CLI hands it to kvpush.benchmarks.cli, and says what to install
when the benchmarks or the ``bench`` extra (Pillow) are missing; so does ``kvpush ttft --png``.

A missing package is simulated in a child interpreter by a ``None`` entry in ``sys.modules``
(what Python's import system treats as "cannot be imported"), so this process keeps its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.services import cli


def run_without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where ``module`` cannot be imported."""
    script = f"import sys\nsys.modules[{module!r}] = None\n{code}"
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )


def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvpush bench")
    for action in ("transport", "idle", "serve", "report", "soak"):
        assert f"\n    {action}" in out


def test_a_bench_action_gets_every_argument_after_bench(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "report", "--out", "doc.md"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "kvpush bench report: error: the following arguments are required: RESULTS" in err


def test_bench_without_pillow_names_the_extra_before_running(tmp_path: Path) -> None:
    results, doc = tmp_path / "results.json", tmp_path / "doc.md"
    code = (
        "from kvpush.services.cli import main\n"
        f"sys.exit(main(['bench', 'report', {str(results)!r}, '--out', {str(doc)!r}]))"
    )
    done = run_without("PIL", code)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "kvpush bench: missing pillow (the bench extra): pip install 'kvpush[bench]'"
    )
    assert not doc.exists()


def test_bench_without_the_benchmarks_package_says_they_are_not_installed() -> None:
    done = run_without(
        "kvpush.benchmarks",
        "from kvpush.services.cli import main\nsys.exit(main(['bench', 'serve', '--quick']))",
    )
    assert done.returncode == 2, done.stderr
    assert "kvpush bench: the benchmarks (kvpush.benchmarks" in done.stderr
    assert "are not installed: pip install -e '.[bench]'" in done.stderr


def test_ttft_png_without_pillow_is_a_usage_error_naming_the_extra(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    spans.write_text("")
    code = (
        "from kvpush.services.telemetry import ttft\n"
        f"sys.exit(ttft.main([{str(spans)!r}, '--png', {str(tmp_path / 'w.png')!r}]))"
    )
    done = run_without("PIL", code)
    assert done.returncode == 2, done.stderr
    assert "--png needs Pillow, in the bench extra: pip install 'kvpush[bench]'" in done.stderr
