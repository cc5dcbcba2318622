"""Import ``kvpush`` from a plain checkout on a GPU host where it is not installed.

The GPU scripts run on lent machines from a copy of the working tree, with vLLM from a bundle
and no ``pip install -e .``: :func:`ensure_kvpush_importable` puts a temporary folder of
``kvpush/<package>`` symlinks (one per folder of pyproject's package-dir) on ``sys.path`` and
``PYTHONPATH``, so child processes import the same tree.

Threading model: call it from the main thread before starting children; it changes the process
environment.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "schemas", "services", "benchmarks")  # kvpush.<name> = REPO/<name>


def ensure_kvpush_importable() -> str | None:
    """The symlink folder put on the path, or None where ``kvpush`` imports already."""
    try:
        import kvpush.benchmarks
        import kvpush.connector

        return None
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="kvpush-path-"))
    (root / "kvpush").mkdir()
    for name in PACKAGES:
        (root / "kvpush" / name).symlink_to(REPO / name)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
    )
    import kvpush.connector  # noqa: F401

    return str(root)
