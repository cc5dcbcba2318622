"""kvpush connector: KV movement between engines.

Two layers: a vLLM-free transport (NIXL agent, KV pool layout, side channel, transfer state
machine) and a vLLM adapter (KVConnectorBase_V1 subclass) that drives it.
"""
