"""AsyncEngine: the asyncio API, with the engine core in its own process.

The front-end keeps input processing (tokenize, chat template, validation) and output
processing (incremental detokenization, stop strings, logprobs). Outputs are processed on the
core client's output thread, off the event loop, and handed to each request's asyncio queue
with `call_soon_threadsafe`; a lock orders that thread against add / abort on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from v1_engine.config import EngineConfig, ModelConfig
from v1_engine.engine.core_client import DEFAULT_STARTUP_TIMEOUT_S, EngineCoreProcClient
from v1_engine.engine.exceptions import EngineDeadError
from v1_engine.engine.input_processor import ChatMessages, ChatOptions, InputProcessor, PromptType
from v1_engine.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from v1_engine.engine.prepare import prepare_engine_config
from v1_engine.metrics.base import StatLoggerBase
from v1_engine.models.loader import get_tokenizer
from v1_engine.outputs import RequestOutput
from v1_engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason
from v1_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One generate() call: its event loop, its queue, and the core requests it fans out to."""

    loop: asyncio.AbstractEventLoop
    core_request_ids: list[str]
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """Called by the output processor from the client's thread: hop onto the loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is closed; nobody is left to read this


class AsyncEngine:
    """Stream generations from an engine core running in a separate process.

    `model=None` serves the embedded default model; keyword arguments are those of `LLM`
    (routed to the EngineConfig sections). `stat_loggers` are called after every batch of core
    outputs (see metrics/base.py).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        stat_loggers: Sequence[StatLoggerBase] | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        hf_config = prepare_engine_config(self.config)
        self.tokenizer = get_tokenizer(self.config.model_config.tokenizer)
        self.input_processor = InputProcessor(self.config, self.tokenizer, hf_config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._dead_error: EngineDeadError | None = None
        self.engine_core = EngineCoreProcClient(
            self.config,
            on_outputs=self._on_core_outputs,
            on_dead=self._on_core_dead,
            startup_timeout_s=startup_timeout_s,
        )
        self.num_kv_blocks = self.engine_core.ready.num_kv_blocks

    # -- public API ----------------------------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def is_healthy(self) -> bool:
        return self._dead_error is None and self.engine_core.is_alive

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as they come: each holds only the new text / tokens of
        one completion (`outputs[0].index` tells which when n > 1); the last has
        `finished=True`. A prompt that fails validation raises ValueError here, alone. Without
        sampling_params, the model's recommended sampling (LLM.get_default_sampling_params);
        `priority` orders requests under the priority scheduling policy (lower first)."""
        self._raise_if_dead()
        prompt_text, token_ids = self.input_processor.tokenize(prompt)
        outputs = self._generate(prompt_text, token_ids, sampling_params, request_id, priority)
        async with contextlib.aclosing(outputs):  # closing us must close it (and abort) now
            async for output in outputs:
                yield output

    async def chat(
        self,
        messages: ChatMessages,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Like generate(), for a conversation rendered with the model's chat template (with
        `tools`, OpenAI function tools, for templates that render them; LLM.chat says what the
        other options do)."""
        self._raise_if_dead()
        options = ChatOptions(add_generation_prompt, tools, continue_final_message,
                              chat_template_kwargs, chat_template)  # fmt: skip
        prompt_text, token_ids = self.input_processor.chat_token_ids(messages, options)
        outputs = self._generate(prompt_text, token_ids, sampling_params, request_id, priority)
        async with contextlib.aclosing(outputs):  # closing us must close it (and abort) now
            async for output in outputs:
                yield output

    async def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends with a final output whose finish_reason is "abort",
        and the core frees its KV blocks. Unknown or finished requests are ignored."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._abort_stream(stream)

    def _abort_stream(self, stream: _Stream) -> None:
        """Finish the stream's requests as aborted (counted by the stat loggers, like any
        finish) and stop them in the core."""
        final = EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT)
                for r in stream.core_request_ids
            ]
        )
        with self._lock:
            known = [r for r in stream.core_request_ids if r in self.output_processor.states]
            processed = self.output_processor.process_outputs(final)
            self._record_stats(None, processed.request_outputs)
        self._abort_in_core(known)

    async def get_num_free_blocks(self) -> int:
        """Free KV blocks in the core (cached-but-unused blocks count as free)."""
        return await self._call_utility("get_num_free_blocks")

    async def reset_prefix_cache(self) -> bool:
        return await self._call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stop the core process and remove its sockets; pending requests raise EngineDeadError."""
        self.engine_core.shutdown()
        self._fail_all_streams(EngineDeadError("the engine has been shut down"))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- request lifecycle ---------------------------------------------------------------------

    async def _generate(
        self,
        prompt: str | None,
        token_ids: list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        processor = self.input_processor
        params = processor.default_sampling_params() if sampling_params is None else sampling_params
        request_id = uuid.uuid4().hex if request_id is None else request_id
        core_requests = processor.process_fan_out(request_id, token_ids, params, priority=priority)
        stream = self._register(request_id, prompt, core_requests, params.n)
        finished = False
        try:
            self.engine_core.add_requests(core_requests)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                # Cancelled, closed early, or failed: make sure the core stops computing it.
                self._abort_stream(stream)

    def _register(
        self, request_id: str, prompt: str | None, core_requests: list, n: int
    ) -> _Stream:
        """Make the request known to the output processor before the core can answer."""
        stream = _Stream(asyncio.get_running_loop(), [r.request_id for r in core_requests])
        parent = ParentRequest(request_id, n) if n > 1 else None
        with self._lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            for index, core_request in enumerate(core_requests):
                self.output_processor.add_request(
                    core_request, prompt, OutputKind.DELTA, parent, index, queue=stream
                )
            self._streams[request_id] = stream
        return stream

    def _abort_in_core(self, core_request_ids: list[str]) -> None:
        if not core_request_ids or not self.engine_core.is_alive:
            return
        try:
            self.engine_core.abort_requests(core_request_ids)
        except EngineDeadError:
            pass  # a dead core holds no blocks anymore

    async def _call_utility(self, method: str, *args: Any) -> Any:
        self._raise_if_dead()
        return await asyncio.wrap_future(self.engine_core.call_utility(method, *args))

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))
        if not self.engine_core.is_alive:
            raise EngineDeadError("the engine has been shut down")

    # -- called from the core client's output thread -------------------------------------------

    def _on_core_outputs(self, outputs: EngineCoreOutputs) -> None:
        with self._lock:
            processed = self.output_processor.process_outputs(outputs)
            self._record_stats(outputs.scheduler_stats, processed.request_outputs)
        self._abort_in_core(processed.reqs_to_abort)

    def do_log_stats(self) -> None:
        """Let the stat loggers see the time pass without outputs (the server calls this every
        second, so a periodic logger writes the last busy interval when the work stops)."""
        with self._lock:
            self._record_stats(None, [])

    def _record_stats(self, scheduler_stats: Any, request_outputs: list[RequestOutput]) -> None:
        """Runs under the lock, so loggers are never called concurrently."""
        now = time.time()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, request_outputs, now)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def _on_core_dead(self, reason: str) -> None:
        self._fail_all_streams(EngineDeadError(reason))

    def _fail_all_streams(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead_error is None:
                self._dead_error = error
            streams = list(self._streams.values())
            self.output_processor.abort_requests(
                [r for stream in streams for r in stream.core_request_ids]
            )
        for stream in streams:
            stream.put_nowait(EngineDeadError(str(error)))
