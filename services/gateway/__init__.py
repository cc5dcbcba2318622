"""kvpush gateway: OpenAI-compatible HTTP in front of prefill/decode workers on NATS.

``app`` (lifecycle, CLI entry points), ``config`` (flags, environment), ``model`` (tokenizer,
name, context length), ``handlers`` (endpoints, auth, errors), ``flow`` (one request's life),
``openai_api`` (parsing, validation, response shapes), ``routing`` (worker registry, P/D and
mode choice), ``streaming`` (token chunks back from decode workers), ``metrics`` (Prometheus),
``observe`` (TTFT breakdowns and KV transfers learned after the fact), ``dashboard``
(``/dashboard``), ``openapi_doc`` (``/openapi.json``), ``openapi_schemas`` (its component
schemas).

Threading model: one asyncio loop per gateway; tokenization on one dedicated thread.
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
