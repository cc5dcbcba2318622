"""The GIL's switch interval in kvpush's processes: how long a thread that wants the GIL waits
before the thread holding it is made to let go.

Every kvpush process runs several Python threads that hand work to each other: the gateway's
loop and vLLM's renderer threads, a worker's loop and its engine client's, an engine core's busy
loop beside its input, output, KV-event and kvpush bus threads. A thread woken by such a
hand-off (a socket readable, ``call_soon_threadsafe``) gets the GIL only when its holder blocks
or, if the holder keeps computing, after CPython's switch interval: 5 ms by default, the same
order as the parts of TTFT kvpush spends around the engine step. ``apply_switch_interval`` sets
it to ``KVPUSH_GIL_SWITCH_US`` microseconds (``DEFAULT_SWITCH_US`` when unset or empty; CPython's
own 5 ms is ``5000``). Each process sets it at its start: the gateway and the workers from their
entry points, the processes vLLM starts for an engine (its engine core, each TP rank) from
``KVPushConnector``'s constructor, which vLLM runs in each of them (the variable is inherited
with the environment).

Threading model: none (``sys.setswitchinterval`` is process-wide; called once at a start).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

SWITCH_ENV = "KVPUSH_GIL_SWITCH_US"
DEFAULT_SWITCH_US = 500
MIN_SWITCH_US, MAX_SWITCH_US = 50, 100_000


def switch_interval_us(environ: Mapping[str, str] | None = None) -> int:
    """The interval ``KVPUSH_GIL_SWITCH_US`` asks for; ValueError (saying why) if unusable."""
    raw = (os.environ if environ is None else environ).get(SWITCH_ENV, "").strip()
    if not raw:
        return DEFAULT_SWITCH_US
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{SWITCH_ENV}={raw!r}: not a whole number of microseconds") from None
    if not MIN_SWITCH_US <= value <= MAX_SWITCH_US:
        raise ValueError(
            f"{SWITCH_ENV}={value}: outside {MIN_SWITCH_US}..{MAX_SWITCH_US} microseconds"
        )
    return value


def apply_switch_interval(environ: Mapping[str, str] | None = None) -> int:
    """Set this process's switch interval (``switch_interval_us``); returns it in
    microseconds. ValueError, with the process's interval unchanged, if the variable is
    unusable."""
    value = switch_interval_us(environ)
    sys.setswitchinterval(value / 1e6)
    return value
