"""vLLM's own OpenAI serving layer in the gateway, over kvpush's bus engine client.

kvpush answers as ``vllm serve`` does because it runs vLLM's code for everything a server does
before and after the engine: request models and validation, chat templates (roles, tools,
``chat_template_kwargs``), tokenization and ``truncate_prompt_tokens``, ``max_tokens`` clamped
to the context, the model's generation-config defaults, ``SamplingParams`` construction,
structured-output and tool/reasoning parsing of the answer, logprob, echo, ``n`` and usage
shapes, ``/tokenize``, ``/detokenize`` and ``/v1/models``. ``build_serving`` parses vLLM's own
``vllm serve`` flags (``vllm_args``), makes the ``VllmConfig`` (no engine), a renderer and an
input processor; ``VllmServing.init`` calls vLLM's ``init_app_state`` with ``BusEngineClient``
(``engine_client``). What differs between vLLM 0.26 (GPU hosts) and 0.32 (CPU) is a few import
paths, handled where they are imported.

What stays kvpush's: the engine client (``engine_client``: routing, the bus, deadlines,
aborts, traces), admission, auth, metrics, the HTTP server (``http_server``, ``openai_routes``)
and the OpenAPI document (``openapi_doc``, from the same request models).

Threading model: ``build_serving`` blocks (imports vLLM, reads the model folder: seconds) and
runs on a worker thread at start; ``init`` runs on the gateway's loop. The serving objects are
then used from the loop only; vLLM's renderer tokenizes prompts on a pool of its own
(``TOKENIZER_THREADS`` threads, at most one per core: its ``--renderer-num-workers``), a long
text prompt in pieces at once (``long_prompts``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from kvpush.services.gateway import long_prompts

if TYPE_CHECKING:
    from kvpush.services.gateway.config import GatewayConfig

TOKENIZER_THREADS = 4  # prompts tokenized at once (the HF tokenizer releases the GIL)


def tokenizer_threads() -> int:
    """``TOKENIZER_THREADS``, at most one per core this process may run on."""
    return max(1, min(TOKENIZER_THREADS, len(os.sched_getaffinity(0))))


@dataclasses.dataclass
class VllmServing:
    """vLLM's serving objects (set by ``init``) and the config they were built from."""

    args: Any  # vLLM's parsed ``vllm serve`` namespace
    vllm_config: Any
    renderer: Any
    input_processor: Any
    completion: Any = None
    chat: Any = None
    tokenization: Any = None
    models: Any = None

    async def init(self, engine_client: Any) -> None:
        """vLLM's ``init_app_state`` with ``engine_client``: the version's own serving objects."""
        from starlette.datastructures import State

        try:
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        except ImportError:  # vLLM 0.26
            from vllm.entrypoints.openai.api_server import init_app_state

        state = State()
        await init_app_state(engine_client, state, self.args, ("generate",))
        self.completion = state.openai_serving_completion
        self.chat = state.openai_serving_chat
        self.tokenization = state.serving_tokenization
        self.models = state.openai_serving_models


def build_serving(config: GatewayConfig, default_name: str, max_model_len: int) -> VllmServing:
    """Parse the flags, make the VllmConfig, renderer and input processor (blocking)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.input_processor import InputProcessor

    from kvpush.services.gateway.config import ConfigError

    # model, names (the gateway answers to each), context, then the `vllm serve` flags given
    names = config.served_model_name.split(",") if config.served_model_name else [default_name]
    argv = ["--model", str(config.model), "--served-model-name", *names]
    argv += ["--max-model-len", str(config.max_model_len or max_model_len), "--disable-log-stats"]
    # prompts tokenized on several threads at once (vLLM's default is one: requests that come
    # together queue behind each other's tokenization); a --vllm-arg given later wins
    workers = ["--renderer-num-workers", str(tokenizer_threads())]
    for tokenizers in (workers, []):  # one thread where vLLM refuses several (multimodal cache)
        try:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(
                [*argv, *tokenizers, *config.vllm_args]
            )
            validate_parsed_serve_args(args)
            # copies --reasoning-parser where init_app_state reads it
            vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
            break
        except SystemExit:
            flags = [*argv[2:], *config.vllm_args]
            raise ConfigError(f"vLLM rejected the serving flags {flags}") from None
        except (ValueError, TypeError) as exc:
            if tokenizers and "renderer-num-workers" in str(exc):
                continue
            raise ConfigError(f"vLLM rejected the serving flags: {exc}") from None
    renderer = renderer_from_config(vllm_config)
    long_prompts.install(renderer)  # long text prompts: tokenized in pieces at once
    return VllmServing(args, vllm_config, renderer, InputProcessor(vllm_config, renderer))
