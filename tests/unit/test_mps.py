"""``kvpush up --mps on``: a private MPS control daemon (``kvpush.services.mps``), its pipe and
log folders handed to every engine. The control program here is a script that records how it
was called (the real one runs on the H200, tests/gpu/h200.sh)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvpush.services.mps import MpsDaemon, MpsError

CONTROL = """#!/bin/sh
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {calls}
[ -t 0 ] || cat >> {calls}
exit {status}
"""


def _control(tmp_path: Path, status: int = 0) -> tuple[str, Path]:
    calls = tmp_path / "calls"
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(CONTROL.format(calls=calls, status=status))
    script.chmod(0o755)
    return str(script), calls


def test_the_stack_s_own_daemon_starts_hands_its_folders_on_and_quits(tmp_path) -> None:
    control, calls = _control(tmp_path)
    daemon = MpsDaemon(control)
    env = daemon.start()
    pipe, log = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    assert pipe.is_dir() and log.is_dir() and pipe.parent == Path(daemon.folder)
    assert f"args=-d pipe={pipe} log={log}" in calls.read_text()
    daemon.stop()
    said = calls.read_text()
    assert f"args= pipe={pipe} log={log}" in said and said.rstrip().endswith("quit")
    assert not pipe.parent.exists() and daemon.folder == ""
    daemon.stop()  # once is enough: nothing left to stop


def test_mps_that_cannot_start_says_why_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MpsError, match="not on PATH"):
        MpsDaemon().start()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the daemon's folder: here
    daemon = MpsDaemon(_control(tmp_path, status=3)[0])
    with pytest.raises(MpsError, match=r"-d failed \(3\)"):
        daemon.start()
    assert daemon.folder == "" and not list(tmp_path.glob("kvpush-mps-*"))
