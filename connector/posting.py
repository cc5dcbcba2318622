"""Posting: how an initiator transfer's layers become NIXL requests.

``plan_layers`` fills a transfer's per-layer plan once its peer is attached: prepped index
tables (when both pools are prepped and whole blocks move), descriptors and bytes per layer.
``post_request`` posts one request for a group of layers: rows of the prepped per-block lists
(NIXL merges them), or coalesced descriptor rows when a pool was too big to prep or only a
slice of each block moves (a peer of another TP).

Threading model: none of its own; ``TransferEngine`` (engine.py) calls these under the
transport's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpush.connector.agent import NixlAgent, XferHandle, XferStatus
from kvpush.connector.layout import (
    PoolLayout,
    count_descriptors,
    descriptor_pair,
    layer_index_tables,
)
from kvpush.connector.transfer import PeerLink, Role, Transfer


def plan_layers(t: Transfer, layout: PoolLayout, remote: PoolLayout, prepped: bool) -> None:
    """Per-layer index tables (``prepped``: both sides have prepped lists), descriptors and
    bytes of ``t``, whose segments are set and checked against ``remote``."""
    parts = t.leg.parts
    if prepped and parts[0].whole and parts[1].whole:
        t.local_index = layer_index_tables(layout, t.local_ids)
        t.remote_index = layer_index_tables(remote, t.remote_ids)
    layers = range(layout.num_layers)
    t.layer_descs = [count_descriptors(layout, remote, [i], t.segments, parts) for i in layers]
    t.layer_nbytes = [
        int(t.local_ids.size) * layout.layer_bytes([i]) // parts[0].parts for i in layers
    ]


def post_request(
    agent: NixlAgent,
    layout: PoolLayout,
    local_prep: Any | None,
    peer: PeerLink,
    t: Transfer,
    layers: tuple[int, ...],
) -> tuple[XferHandle, XferStatus, int, int]:
    """Post one WRITE (push) or READ (pull) of ``layers``: its handle, first status, bytes and
    descriptors. Raises ``AgentError`` when NIXL refuses it."""
    op = "WRITE" if t.role is Role.PUSH else "READ"
    nbytes = sum(t.layer_nbytes[layer] for layer in layers)
    descs = sum(t.layer_descs[layer] for layer in layers)
    if t.local_index is not None and t.remote_index is not None:
        handle, status = agent.post_prepped(
            op,
            local_prep,
            _rows(t.local_index, layers),
            peer.prep,
            _rows(t.remote_index, layers),
            nbytes,
            descs,
        )
    else:
        remote = peer.info.pool
        lrows, rrows = descriptor_pair(layout, remote, layers, t.segments, t.leg.parts)
        handle, status = agent.post_rows(op, lrows, rrows, peer.agent_name, layout.mem_type, nbytes)
    return handle, status, nbytes, descs


def _rows(tables: list[np.ndarray], layers: tuple[int, ...]) -> np.ndarray:
    return tables[layers[0]] if len(layers) == 1 else np.concatenate([tables[i] for i in layers])
