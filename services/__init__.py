"""kvpush services: the thin processes (gateway, prefill and decode workers, CLI) and their
shared plumbing (NATS bus client, embedded nats-server, telemetry, local models)."""
