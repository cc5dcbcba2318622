"""The OpenAI routes, answered by vLLM's serving layer (``vllm_serving``) over kvpush's engine
client.

``/v1/completions`` and ``/v1/chat/completions``: the body becomes vLLM's own request model
(pydantic; a validation error is the 400 vLLM's server answers), the ``kvpush_mode`` extension
is taken off it first, the request is admitted (``GatewayApi.admit``: 503 while draining, a
queued slot, its ``gateway.request`` span), and vLLM's ``create_completion`` /
``create_chat_completion`` runs with a ``bus_generation.RequestContext`` in the context (the
engine client's ``generate`` reads it; it names the answer's first engine request by the
answer's id, as vLLM makes it from ``X-Request-Id`` or the request's ``request_id``). Its
result is written as vLLM's server writes it: an ``ErrorResponse`` with its code, a response
model as JSON, a stream as SSE. An engine request that failed before anything was sent (no
worker 503, deadline 504, worker error 502) answers with its own status, not a 200 stream
that carries an error; once the stream started an error is an ``{"error": ...}`` event, then
``[DONE]`` (vLLM's shape). ``/tokenize``, ``/detokenize``, ``/v1/models`` and ``/version`` are
vLLM's too. The response's ``X-Request-Id`` is the client's, else the answer's id.

Threading model: handlers on the gateway's event loop.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
from aiohttp import web

from kvpush.schemas.messages import TransferMode
from kvpush.services.gateway.bus_generation import CURRENT, RequestContext
from kvpush.services.gateway.errors import ApiError, json_response

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvpush.services.gateway.vllm_serving import VllmServing

# the gateway's admission of a generation request (``GatewayApi.admit``): its span in the body
Admit = Callable[[str], AbstractAsyncContextManager["Span"]]


def _dump(model: Any) -> bytes:
    return model.model_dump_json().encode()


class RawRequest:
    """What vLLM's serving methods read of a Starlette request: headers and ``state``."""

    def __init__(self, request: web.Request, args: Any) -> None:
        self.headers = request.headers
        self.state = types.SimpleNamespace()
        self.app = types.SimpleNamespace(state=types.SimpleNamespace(args=args))


def _mode(data: dict[str, Any]) -> TransferMode | None:
    value = data.pop("kvpush_mode", None)
    if value is None:
        return None
    try:
        return TransferMode(value)
    except ValueError:
        raise ApiError(
            400, "'kvpush_mode' must be one of push, pull, local", param="kvpush_mode"
        ) from None


class OpenAIRoutes:
    """The routes of vLLM's OpenAI server, over ``serving``'s objects."""

    def __init__(self, serving: VllmServing, admit: Admit) -> None:
        self.serving, self.admit = serving, admit
        import pydantic
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
            ChatCompletionResponse,
        )
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionRequest,
            CompletionResponse,
        )
        from vllm.entrypoints.serve.tokenize.protocol import (
            DetokenizeRequest,
            DetokenizeResponse,
            TokenizeRequest,
            TokenizeResponse,
        )

        try:
            from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelList
        except ImportError:  # vLLM 0.26
            from vllm.entrypoints.openai.engine.protocol import ErrorResponse, ModelList
        # the models requests are validated with (tokenize's is a union: a TypeAdapter's)
        self.models_of: dict[str, Any] = {
            "completion": CompletionRequest,
            "chat": ChatCompletionRequest,
            "tokenize": TokenizeRequest,
            "detokenize": DetokenizeRequest,
        }
        self.answers_of: dict[str, Any] = {
            "completion": CompletionResponse,
            "chat": ChatCompletionResponse,
            "tokenize": TokenizeResponse,
            "detokenize": DetokenizeResponse,
            "models": ModelList,
        }
        self.error_type = ErrorResponse
        # built once; an adapter validates a union (tokenize's) as well as a model
        self._adapters = {key: pydantic.TypeAdapter(m) for key, m in self.models_of.items()}

    def served_names(self) -> list[str]:
        """The model names vLLM's serving layer answers to (``--served-model-name``)."""
        return [path.name for path in self.serving.models.base_model_paths]

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/version", self.version)

    # ---- parsing --------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await request.read()  # too large: aiohttp's 413, answered by the middleware
        try:
            data = msgspec.json.decode(body)
        except Exception:  # msgspec.DecodeError, RecursionError, ...: all mean bad JSON
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    async def _validated(self, key: str, data: dict[str, Any], request: web.Request) -> Any:
        import pydantic

        try:
            return self._adapters[key].validate_python(data)
        except pydantic.ValidationError as exc:
            raise await self._validation_error(exc, request) from None
        except Exception as exc:  # a model validator's VLLMValidationError, ...
            self._raise_as_vllm(exc)

    async def _validation_error(self, exc: Any, request: web.Request) -> ApiError:
        """vLLM's own 400 for a request its models reject (its message format)."""
        from fastapi.exceptions import RequestValidationError

        try:
            from vllm.entrypoints.serve.exception_handling.handlers.validation import (
                validation_exception_handler,
            )
        except ImportError:  # vLLM 0.26
            from vllm.entrypoints.serve.utils.server_utils import validation_exception_handler
        fake = RawRequest(request, self.serving.args)
        answer = await validation_exception_handler(fake, RequestValidationError(exc.errors()))
        body = msgspec.json.decode(answer.body)
        error = body.get("error", {})
        return ApiError(
            answer.status_code,
            str(error.get("message", "invalid request")),
            type_=str(error.get("type", "BadRequestError")),
            param=error.get("param"),
            code=error.get("code", answer.status_code),
        )

    # ---- generation -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        data = await self._body(request)
        mode = _mode(data)
        parsed = await self._validated(kind, data, request)
        # the answer's id as vLLM's serving layer makes it (a client's X-Request-Id, else the
        # request model's random request_id)
        base = request.headers.get("X-Request-Id") or parsed.request_id
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{base}"
        async with self.admit("chat" if kind == "chat" else "text_completion") as span:
            context = RequestContext(span=span, mode=mode, response_id=response_id)
            token = CURRENT.set(context)
            try:
                return await self._serve(request, kind, parsed, context)
            finally:
                CURRENT.reset(token)

    async def _serve(
        self, request: web.Request, kind: str, parsed: Any, context: RequestContext
    ) -> web.StreamResponse:
        raw = RawRequest(request, self.serving.args)
        try:
            if kind == "chat":
                result = await self.serving.chat.create_chat_completion(parsed, raw)
            else:
                result = await self.serving.completion.create_completion(parsed, raw)
        except ApiError:
            raise
        except Exception as exc:  # vLLM's errors (VLLMValidationError, ValueError, ...)
            if context.error is not None:
                raise context.error from None
            self._raise_as_vllm(exc)
        if context.error is not None and not context.sent_first:
            if hasattr(result, "aclose"):
                await result.aclose()
            raise context.error
        return await self._answer(request, result, context)

    async def _answer(
        self, request: web.Request, result: Any, context: RequestContext
    ) -> web.StreamResponse:
        if isinstance(result, self.error_type):
            return web.Response(
                body=_dump(result), status=result.error.code, content_type="application/json"
            )
        if not hasattr(result, "__aiter__"):
            response = web.Response(body=_dump(result), content_type="application/json")
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", result.id)
            return response
        first = await anext(result, None)  # an error before any answer gets its own status
        if context.error is not None and not context.sent_first:
            await result.aclose()
            raise context.error
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        if "X-Request-Id" in request.headers:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(first.encode())
            async for item in result:
                await response.write(item.encode())
            await response.write_eof()
        except ConnectionError:  # the client went away while we wrote
            await result.aclose()
        return response

    # ---- the rest of vLLM's routes --------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        parsed = await self._validated("tokenize", await self._body(request), request)
        raw = RawRequest(request, self.serving.args)
        return self._plain(await self._vllm(self.serving.tokenization.create_tokenize(parsed, raw)))

    async def detokenize(self, request: web.Request) -> web.Response:
        parsed = await self._validated("detokenize", await self._body(request), request)
        raw = RawRequest(request, self.serving.args)
        try:
            result = await self._vllm(self.serving.tokenization.create_detokenize(parsed, raw))
        except OverflowError:  # an id past the tokenizer's u32 (`vllm serve`: a 500)
            raise ApiError(400, "token ids must be within 0..2**32-1", param="tokens") from None
        return self._plain(result)

    async def _vllm(self, call: Awaitable[Any]) -> Any:
        """vLLM's answer, or its error as the status vLLM's server gives it (a 500: raised)."""
        try:
            return await call
        except (ApiError, OverflowError):
            raise
        except Exception as exc:  # vLLM's errors (VLLMValidationError, ValueError, ...)
            self._raise_as_vllm(exc)

    def _raise_as_vllm(self, exc: Exception) -> NoReturn:
        """``exc`` as the status vLLM's server gives it; a 500 is raised as it is (not the
        client's: the middleware logs it and answers a bare 500)."""
        error = self.serving.completion.create_error_response(exc).error
        if int(error.code) >= 500:
            raise exc
        raise ApiError(
            int(error.code), error.message, type_=error.type, param=error.param, code=error.code
        ) from None

    def _plain(self, result: Any) -> web.Response:
        status = result.error.code if isinstance(result, self.error_type) else 200
        return web.Response(body=_dump(result), status=status, content_type="application/json")

    async def list_models(self, request: web.Request) -> web.Response:
        return self._plain(await self.serving.models.show_available_models())

    async def version(self, request: web.Request) -> web.Response:
        import vllm

        return json_response({"version": vllm.__version__})
