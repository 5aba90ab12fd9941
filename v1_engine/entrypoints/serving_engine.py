"""What completions and chat share: model-name checks, prompt length checks, running one
engine request with disconnect handling, and mapping engine errors to HTTP errors.

The engine streams DELTA RequestOutputs; `stream_outputs` wraps one `engine.generate` call so
that, whatever makes the consumer stop (client disconnect, cancellation, an error), the request
is aborted in the engine and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request

from v1_engine.engine.exceptions import EngineDeadError
from v1_engine.engine.input_processor import (
    ChatFieldError,
    ChatOptions,
    NoChatTemplateError,
    check_chat_template,
)
from v1_engine.entrypoints.errors import APIError, from_value_error
from v1_engine.outputs import RequestOutput
from v1_engine.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

SAMPLING_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "prompt_logprobs",
    "top_logprobs",
    "prompt",
    "messages",
    "request_id",
}


@dataclass
class ServerOptions:
    """How v1serve serves (its server flags; the engine's settings live in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    tool_call_parser: str | None = None
    """Reads the calls of tool_choice "auto" (tool_parsers.TOOL_PARSERS); None refuses it."""
    reasoning_parser: str | None = None
    """Splits the reasoning off (reasoning_parsers.REASONING_PARSERS)."""
    trust_request_chat_template: bool = False
    """Lets chat and /tokenize requests bring their own chat template."""
    allowed_origins: list[str] = field(default_factory=list)
    """Browser origins allowed cross-origin requests (CORS; "*" for any); none by default."""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    """With both: HTTPS."""
    root_path: str = ""
    """The path prefix a proxy serves the app under (ASGI root_path)."""
    log_requests: bool = False
    """Log each request's arrival (prompt length, sampling) and end (reason, tokens, time)."""

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


class OpenAIServing:
    """Per-server state every endpoint needs: the engine, its tokenizer and the model name."""

    def __init__(self, engine: Any, options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.options = options or ServerOptions()
        mc = engine.config.model_config
        self.served_model_name: str = mc.served_model_name or str(mc.model)
        self.max_model_len = int(mc.max_model_len)
        self.tokenizer = engine.get_tokenizer()
        self.processor = engine.input_processor
        """The engine's InputProcessor: renders chats and checks requests as the engine will."""
        self.default_sampling: dict[str, Any] = self.processor.generation.sampling
        """The model's recommended sampling: what a request leaves unset takes these."""

    def check_request(self, body: Any) -> None:
        """What every generation request must get right before its prompt is looked at: the
        model name, a priority the scheduling policy uses, and stream_options only with stream
        (OpenAI's rule)."""
        self.check_model(body.model)
        try:
            self.processor.check_priority(body.priority)
        except ValueError as e:
            raise APIError(str(e), param="priority") from None
        if body.stream_options is not None and not body.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"`{self.served_model_name}`",
                HTTPStatus.NOT_FOUND,
                param="model",
                code="model_not_found",
            )

    def tokenize_prompt(
        self, prompt: str | list[int], add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt must not be empty", param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not prompt:
            raise APIError("prompt must not be an empty list of token ids", param="prompt")
        return list(prompt)

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        """Every id in [0, vocabulary size), else a 400 naming `field`, the request's field."""
        vocab = len(self.tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{field} must be token ids in [0, {vocab}), got {bad[:5]}", param=field)

    def render_chat(self, messages: list[dict[str, Any]], options: ChatOptions) -> list[int]:
        """The conversation's token ids through the model's chat template, or the request's
        own `chat_template` where the server trusts those (InputProcessor.render_chat); a 400
        naming the field that does not fit."""
        if options.chat_template is not None:
            self._check_request_template(options.chat_template)
        try:
            _, token_ids = self.processor.chat_token_ids(messages, options)
        except ChatFieldError as e:
            raise APIError(str(e), param=e.field) from None
        except NoChatTemplateError:
            raise APIError(
                "this model has no chat template; use /v1/completions", param="messages"
            ) from None
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        return token_ids

    def _check_request_template(self, chat_template: str) -> None:
        """A request's own chat template: refused unless the server trusts those (rendering
        runs the template's code in the server), and it must be Jinja text (not a path)."""
        if not self.options.trust_request_chat_template:
            raise APIError(
                "chat_template in a request is refused by this server; start it with "
                "--trust-request-chat-template to allow one",
                param="chat_template",
            )
        if "{{" not in chat_template and "{%" not in chat_template:
            raise APIError(
                "chat_template must be the Jinja text of a template (not a file's path)",
                param="chat_template",
            )
        try:
            check_chat_template(chat_template)
        except ValueError as e:
            raise APIError(f"chat_template {e}", param="chat_template") from None

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, field: str) -> int:
        """Fit the output into the context; a request that cannot fit is the client's error."""
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt_tokens} tokens, which leaves no room for output",
                param="prompt",
                code="context_length_exceeded",
            )
        if requested is None:
            return min(room, self.default_sampling.get("max_tokens", room))
        if requested > room:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                f"prompt, {requested} for the completion). Reduce the prompt or {field}.",
                param=field,
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(self, body: Any, max_tokens: int, **kwargs: Any) -> SamplingParams:
        """The request's SamplingParams; a field that cannot convert (a bad JSON schema, two
        output constraints) is a 400 naming it."""
        try:
            return body.to_sampling_params(max_tokens, self.default_sampling, **kwargs)
        except ValueError as e:
            raise from_value_error(e, SAMPLING_FIELDS) from None

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Run the engine's own request checks now, so a bad request is a 400 even when it
        asked for a stream (once a stream has started, errors can only be SSE events)."""
        try:
            self.processor.validate(token_ids, params)
        except ValueError as e:
            raise from_value_error(e, SAMPLING_FIELDS) from None

    async def stream_outputs(
        self, prompt: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the engine's delta outputs; abort the request if we stop before it finishes."""
        finished = False
        log = (
            _RequestLog(request_id, prompt, params, priority) if self.options.log_requests else None
        )
        generator = self.engine.generate(prompt, params, request_id, priority=priority)
        try:
            async for output in generator:
                finished = output.finished
                if log is not None:
                    log.observe(output)
                yield output
        except ValueError as e:
            finished = True
            raise from_value_error(e, SAMPLING_FIELDS) from None
        except EngineDeadError:
            finished = True
            raise engine_dead_error() from None
        finally:
            # Shielded: under a cancelled anyio scope (client disconnect) any bare await would
            # be cancelled again before the engine hears about the abort.
            # abort() first: it reports the request as finished ("abort") to the stat loggers.
            with anyio.CancelScope(shield=True):
                if not finished:
                    await self.engine.abort(request_id)
                await generator.aclose()
            if log is not None:
                log.end(finished)


class _RequestLog:
    """--enable-log-requests: one INFO line when a request arrives, one when it ends."""

    def __init__(
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int
    ) -> None:
        self.request_id, self.start = request_id, time.monotonic()
        self.num_tokens, self.reasons = 0, set()
        sampling = msgspec.json.encode(params).decode()  # the fields set, not every default
        extra = f", priority {priority}" if priority else ""
        logger.info("request %s: %d prompt tokens, %s%s", request_id, len(prompt), sampling, extra)

    def observe(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            self.num_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                self.reasons.add(completion.finish_reason)

    def end(self, finished: bool) -> None:
        reason = "/".join(sorted(self.reasons)) if finished else "client gone"
        logger.info(
            "request %s finished (%s): %d output tokens in %.2f s",
            self.request_id,
            reason,
            self.num_tokens,
            time.monotonic() - self.start,
        )


def engine_dead_error() -> APIError:
    return APIError(
        "the engine core has died; the server is shutting down",
        HTTPStatus.SERVICE_UNAVAILABLE,
        code="engine_dead",
    )


async def merge_streams(
    streams: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagging each with its stream index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
                await tasks[index]  # re-raises the stream's error, if it ended with one
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run a non-streaming request; if its client goes away first, cancel it (which aborts the
    engine requests it started) instead of computing an answer nobody will read."""
    work_task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise APIError("client disconnected", HTTPStatus.BAD_REQUEST, code="client_disconnected")
    return work_task.result()


def sse(payload: Any) -> str:
    """One server-sent event carrying a pydantic model or a plain dict."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
