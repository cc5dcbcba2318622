"""Tracing setup, span records, the TTFT breakdown and the ``kvpush ttft`` report."""

from kvpush.services.telemetry.setup import configure, configure_from_env, shutdown

__all__ = ["configure", "configure_from_env", "shutdown"]
