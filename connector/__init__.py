"""kvpush connector: KV movement between engines, and the one module services import it through.

Layers inside: a vLLM-free transport (NIXL agent, KV pool layout, side channel, transfer state
machine), the NATS bus client and tracing both halves of a deployment use, and a vLLM adapter
(``kvpush.connector.vllm``: the ``KVConnectorBase_V1`` subclass that drives the transport; vLLM
loads it by ``VLLM_CONNECTOR_MODULE`` / ``VLLM_CONNECTOR_CLASS``). Services import only the
names below (``tests/unit/test_import_graph.py`` holds them to it); nothing here imports vLLM.

Threading model: see each module; importing this package starts no thread.
"""

from kvpush.connector.agent import AgentConfig, NixlAgent, XferStatus
from kvpush.connector.bounded import BoundedDict
from kvpush.connector.bus import DEFAULT_NATS_URL, Bus, BusConfig, BusConnectError
from kvpush.connector.layout import pool_layout, runs_to_ids
from kvpush.connector.link import EngineLink
from kvpush.connector.params import PrefillToken, TransferParams, samples_on_prefill, timing_of
from kvpush.connector.peering import CompatInfo
from kvpush.connector.poller import Poller, worker_intervals
from kvpush.connector.switching import apply_switch_interval
from kvpush.connector.tracing import configure_tracing, emit_span, monotonic_to_ns, tracing_on
from kvpush.connector.transport import KvTransport, TransportConfig
from kvpush.connector.vllm.gate import LayerGate
from kvpush.connector.vllm.runtime import ConnectorInfo
from kvpush.connector.vllm.weights import normal_dummy_weights

VLLM_CONNECTOR_MODULE = "kvpush.connector.vllm.connector"
VLLM_CONNECTOR_CLASS = "KVPushConnector"
FAULTS_CONNECTOR_MODULE = "kvpush.connector.vllm.faults"  # tests and soak runs only
FAULTS_CONNECTOR_CLASS = "SlowPrefillConnector"
# an engine with its engine-core process (vLLM's scheduler_cls and worker_extension_cls)
VLLM_SCHEDULER = "kvpush.connector.vllm.engine_core.kvpush_scheduler"
VLLM_WORKER_EXTENSION = "kvpush.connector.vllm.engine_core.KVPushWorkerExtension"

__all__ = [
    "DEFAULT_NATS_URL",
    "FAULTS_CONNECTOR_CLASS",
    "FAULTS_CONNECTOR_MODULE",
    "VLLM_CONNECTOR_CLASS",
    "VLLM_CONNECTOR_MODULE",
    "VLLM_SCHEDULER",
    "VLLM_WORKER_EXTENSION",
    "AgentConfig",
    "BoundedDict",
    "Bus",
    "BusConfig",
    "BusConnectError",
    "CompatInfo",
    "ConnectorInfo",
    "EngineLink",
    "KvTransport",
    "LayerGate",
    "NixlAgent",
    "Poller",
    "PrefillToken",
    "TransferParams",
    "TransportConfig",
    "XferStatus",
    "apply_switch_interval",
    "configure_tracing",
    "emit_span",
    "monotonic_to_ns",
    "normal_dummy_weights",
    "pool_layout",
    "runs_to_ids",
    "samples_on_prefill",
    "timing_of",
    "tracing_on",
    "worker_intervals",
]
