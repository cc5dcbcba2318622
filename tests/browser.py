"""Headless Chromium for tests: a page's DOM after its scripts ran, and screenshots.

No Python dependency: Debian's ``chromium`` (``make setup`` installs it) runs once per call in
new headless mode with a fresh profile. ``--virtual-time-budget`` lets the page's timers and
fetches run for ``wait_ms`` of virtual time (the clock waits for pending network loads), then
``--dump-dom`` prints the serialized DOM or ``--screenshot`` writes a PNG. The background-
networking flags keep it from calling out (the closed network refuses such connections), and
``--no-sandbox`` is needed as root. ``parse`` turns dumped HTML into a small element tree.

The calls block: from a test whose server runs on the same event loop, use
``await asyncio.to_thread(dump_dom, url, ...)``, or the page never gets an answer.
"""

from __future__ import annotations

import contextlib
import html.parser
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FLAGS = (
    "--headless",
    "--no-sandbox",  # as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,900",
)
_NOISE = ("dbus", "unexpected operator")  # harmless lines on machines without a session bus


class BrowserError(RuntimeError):
    """Chromium missing, failed, or timed out (the message has its stderr tail)."""


def chromium() -> str:
    """The browser binary: ``$KVPUSH_CHROMIUM``, else ``chromium`` on PATH."""
    found = os.environ.get("KVPUSH_CHROMIUM") or shutil.which("chromium")
    if not found:
        raise BrowserError("chromium not found: run `make setup` (installs Debian's chromium)")
    return found


def output_dir() -> Path:
    """``test-output/`` under the repo root (git-ignored), where tests keep screenshots."""
    path = REPO_ROOT / "test-output"
    path.mkdir(exist_ok=True)
    return path


def _tail(stderr: bytes | None, lines: int = 25) -> str:
    text = (stderr or b"").decode(errors="replace").splitlines()
    kept = [line for line in text if not any(n in line for n in _NOISE)]
    return "\n".join(kept[-lines:]) or "(empty)"


def _run(url: str, wait_ms: int, extra: list[str], timeout_s: float) -> bytes:
    """Run chromium once on ``url``; its stdout. Kills its whole process group on timeout."""
    with tempfile.TemporaryDirectory(prefix="kvpush-chromium-", ignore_cleanup_errors=True) as d:
        argv = [
            chromium(),
            *FLAGS,
            f"--user-data-dir={d}",
            f"--virtual-time-budget={wait_ms}",
            *extra,
            url,
        ]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its renderer/GPU children share the group we may kill
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise BrowserError(
                f"chromium timed out after {timeout_s} s on {url}\n"
                f"argv: {' '.join(argv)}\nstderr tail:\n{_tail(err)}"
            ) from None
        with contextlib.suppress(ProcessLookupError):  # leftover helpers, if any
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode != 0:
            raise BrowserError(
                f"chromium exited {proc.returncode} on {url}\n"
                f"argv: {' '.join(argv)}\nstderr tail:\n{_tail(err)}"
            )
        return out


def dump_dom(url: str, wait_ms: int = 3000, *, timeout_s: float = 60.0) -> str:
    """The page's DOM (HTML) after ``wait_ms`` of virtual time."""
    out = _run(url, wait_ms, ["--dump-dom"], timeout_s)
    if not out.strip():
        raise BrowserError(f"chromium printed no DOM for {url}")
    return out.decode("utf-8", errors="replace")


def screenshot(url: str, path: str | Path, wait_ms: int = 3000, *, timeout_s: float = 60.0) -> Path:
    """A 1280x900 PNG of the page after ``wait_ms`` of virtual time, written to ``path``."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    _run(url, wait_ms, [f"--screenshot={path}"], timeout_s)
    if not path.is_file() or path.stat().st_size == 0:
        raise BrowserError(f"chromium wrote no screenshot to {path}")
    return path


# ---- a small DOM for assertions -------------------------------------------------------------
_VOID_TAGS = "area base br col embed hr img input link meta param source track wbr"
_VOID = frozenset(_VOID_TAGS.split())  # elements without an end tag


@dataclass(eq=False)
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    @property
    def text(self) -> str:
        """All text inside, concatenated (entities decoded)."""
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def iter(self) -> Iterator[Element]:
        """This element and every element inside it, in document order."""
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def find_all(self, tag: str | None = None, *, cls: str | None = None) -> list[Element]:
        return [
            e
            for e in self.iter()
            if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
        ]

    def style(self) -> dict[str, str]:
        """The inline style attribute as {property: value}."""
        pairs = (p.split(":", 1) for p in self.attrs.get("style", "").split(";") if ":" in p)
        return {k.strip(): v.strip() for k, v in pairs}


class _Builder(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Element(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(node)
        if tag not in _VOID:
            self._stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i].tag == tag:
                del self._stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].children.append(data)


def parse(markup: str) -> Element:
    """The element tree of ``markup`` (a ``#document`` root)."""
    builder = _Builder()
    builder.feed(markup)
    builder.close()
    return builder.root
