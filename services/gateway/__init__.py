"""kvpush gateway: OpenAI-compatible HTTP in front of prefill/decode workers on NATS.

vLLM's own serving layer answers the OpenAI routes; kvpush supplies its engine: P/D pairs on
the bus. The modules: ``app`` (lifecycle, CLI entry points), ``config`` (flags, environment),
``model`` (served name, context length), ``vllm_serving`` (vLLM's serving layer, built from
``vllm serve`` flags), ``openai_routes`` (the OpenAI routes over it), ``engine_client`` (vLLM's
engine client whose engine is the bus), ``bus_generation`` (one engine request on the bus:
route, publish, chunks, deadlines, aborts), ``http_server`` (routes, auth, admission, the
middleware), ``errors`` (``ApiError``, OpenAI error bodies), ``admission`` (the in-flight
bound and queue), ``routing`` (worker registry, P/D and mode choice), ``streaming`` (token
chunks back from decode workers), ``metrics`` (Prometheus), ``observe`` (TTFT breakdowns and
KV transfers learned after the fact), ``dashboard`` (``/dashboard``), ``cors`` (browser
origins), ``openapi_doc`` (``/openapi.json``, from vLLM's request models).

Threading model: one asyncio loop per gateway; vLLM's renderer tokenizes on its own thread.
"""

from kvpush.services.gateway.app import Gateway, main, serve
from kvpush.services.gateway.config import ConfigError, GatewayConfig, add_arguments
from kvpush.services.gateway.model import ModelInfo, load_model

__all__ = [
    "ConfigError",
    "Gateway",
    "GatewayConfig",
    "ModelInfo",
    "add_arguments",
    "load_model",
    "main",
    "serve",
]
