"""What the gateway needs from a model folder: served name and context length.

``load_model`` reads a Hugging Face model folder (its tokenizer, ``config.json``) and the
optional ``kvpush-model.json`` stamp of models built by ``kvpush model``. The served name is
``--served-model-name`` (the first of a comma list: the name the workers serve; vLLM's serving
layer answers to every one of them), else the stamp's recipe name (``kvpush-tiny``), else the
folder's name; the context length is ``--max-model-len``, else the stamp's ``max_context``, else
``config.json``'s ``max_position_embeddings``, else the tokenizer's ``model_max_length``.

Threading model: ``load_model`` blocks (imports transformers, reads files); the gateway calls it
on a worker thread once at start. ``ModelInfo`` is immutable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpush.services.gateway.config import ConfigError
from kvpush.services.models import read_stamp

if TYPE_CHECKING:
    from kvpush.services.gateway.config import GatewayConfig


@dataclass(frozen=True)
class ModelInfo:
    path: str
    served_name: str
    max_model_len: int


def load_model(config: GatewayConfig) -> ModelInfo:
    """Served name and context length from the model folder (blocking)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model)
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {config.model}: {exc}") from None
    recipe = (read_stamp(config.model) or {}).get("recipe") or {}
    try:
        hf_config = json.loads((Path(config.model) / "config.json").read_text())
    except (OSError, ValueError):
        hf_config = {}
    given = (config.served_model_name or "").split(",")[0].strip()  # the first of several
    name = given or recipe.get("name") or Path(config.model).resolve().name
    limit = getattr(tokenizer, "model_max_length", None)
    max_len = (
        config.max_model_len
        or recipe.get("max_context")
        or hf_config.get("max_position_embeddings")
        or (limit if isinstance(limit, int) and limit < 10**7 else None)
    )
    if not max_len:
        raise ConfigError(f"cannot tell the context length of {config.model}: --max-model-len")
    return ModelInfo(str(config.model), str(name), int(max_len))
