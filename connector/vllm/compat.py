"""What differs between the vLLM versions the connector runs on, in one place.

Supported: vLLM 0.26 (the GPU hosts: their torch 2.11 pins it) through 0.32 (the CPU machines
and CI); ``pyproject.toml`` declares the range. Read against both versions'
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``:

- 0.32's model runner asks ``get_transfer_results`` (finished sending / receiving / **failed**
  receiving); 0.26's asks ``get_finished`` and learns of failed loads only from
  ``get_block_ids_with_load_errors``. A receive that failed is therefore reported on 0.26 as
  finished with its blocks invalid (the scheduler recomputes them: ``kv_load_failure_policy``
  "recompute"), on 0.32 as ``failed_recving``.
- ``KVConnectorTransferResults`` exists only in 0.32; ``TransferResults`` builds it there and is
  a plain value on 0.26, where nothing asks for it.
- Both have the three-argument ``__init__``, ``register_kv_caches``, ``has_pending_push_work``,
  ``build_connector_worker_meta``, the handshake-metadata hooks and ``request_finished``; the
  connector uses nothing else that differs (it leaves 0.26's cross-layer blocks off).

Threading model: none (import-time facts).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm import __version__ as VLLM_VERSION

log = logging.getLogger(__name__)
SUPPORTED = ((0, 26), (0, 33))  # [low, high)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM < 0.27: get_finished + load errors
    KVConnectorTransferResults = None

REPORTS_FAILED_RECVING = KVConnectorTransferResults is not None


def version_tuple(text: str) -> tuple[int, int]:
    major, minor = ([*text.split("."), "0", "0"])[:2]
    return int("".join(c for c in major if c.isdigit()) or 0), int(
        "".join(c for c in minor if c.isdigit()) or 0
    )


def check_version() -> None:
    """Warn (once per connector) when this vLLM is outside the tested range."""
    low, high = SUPPORTED
    if not low <= version_tuple(VLLM_VERSION) < high:
        log.warning(
            "kvpush connector: vLLM %s is outside the supported range %d.%d <= v < %d.%d",
            VLLM_VERSION,
            *low,
            *high,
        )


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """vLLM 0.32's ``KVConnectorTransferResults`` (None on 0.26: nothing asks for it)."""
    if KVConnectorTransferResults is None:
        return None
    return KVConnectorTransferResults(
        finished_sending=sending, finished_recving=recving, failed_recving=failed
    )
