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
- ``continue_from``, the one place the connector changes a vLLM ``Request``: P's first token
  becomes a waiting decode request's last prompt token, the way both versions' streaming-input
  sessions extend a waiting request (``Scheduler._update_request_as_session``).

Threading model: none (import-time facts).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm import __version__ as VLLM_VERSION
from vllm import __version_tuple__ as VLLM_VERSION_TUPLE

log = logging.getLogger(__name__)
SUPPORTED = ((0, 26), (0, 33))  # [low, high)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM < 0.27: get_finished + load errors
    KVConnectorTransferResults = None


def check_version() -> None:
    """Warn (once per connector) when this vLLM is outside the tested range."""
    low, high = SUPPORTED
    if not low <= tuple(VLLM_VERSION_TUPLE[:2]) < high:
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


def continue_from(request: Any, token_id: int) -> None:
    """Make ``token_id`` (the first answer token, sampled by P) the last prompt token of
    ``request``, a decode request whose KV is about to be reported received: vLLM then computes
    that token's KV in the request's first step and samples the second token from it, instead
    of recomputing the prompt's last token to sample the first. The answer still holds
    ``max_tokens`` tokens (the driver reports this one), so the request's own budget (and
    ``min_tokens``) shrink by one; its sampling parameters are copied, not changed in place
    (the engine's output processor holds the same object)."""
    request.prompt_token_ids = [*request.prompt_token_ids, token_id]
    request._all_token_ids.append(token_id)
    request.num_prompt_tokens = len(request.prompt_token_ids)
    request.update_block_hashes()  # a block the token completes gets its prefix-cache hash
    params = request.sampling_params.clone()
    params.max_tokens = request.max_tokens - 1
    params.min_tokens = max(0, params.min_tokens - 1)
    request.sampling_params = params
    request.max_tokens = params.max_tokens
