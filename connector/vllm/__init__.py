"""kvpush's vLLM adapter: ``KVPushConnector`` (connector.py) over a scheduler half (bookkeeping,
scheduler.py) and a worker half (worker.py: NIXL + bus), with the push protocol written out in
prefill_side.py and decode_side.py. Import ``kvpush.connector.vllm.connector`` only where vLLM
is installed; this package's ``__init__`` imports nothing heavy.
"""
